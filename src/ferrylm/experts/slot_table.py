"""The offloading backends' device-side expert table: one fused MoE launch per layer, hits and misses alike, with no
host decision inside a decode step (so the whole step is one CUDA graph).

Protocol (docs/ARCHITECTURE.md, "Offload decode"):

* Every routed expert ``(layer, e)`` has an address in ``table [L, E]`` (int64, device): the BYTE offset of its row
  from ``ref`` (a one-row device tensor whose views the kernel is launched with). An expert in a cache slot points
  at the slot's row; any other expert points at its host bank row, page-locked and mapped into the device's address
  space, which the fused kernel then reads over PCIe itself (zero-copy). ``fused_moe(..., row_offset=table[l])``
  serves both in one launch.
* The graph records each MoE layer's routed ids into ``routed [B, L, k]`` and copies them to a pinned host mirror at
  the end of the step (the engine reads the sampled tokens after every step, so the mirror is complete by then).
* Between steps (:meth:`SlotTable.plan`, called by the executor before a decode step is launched) the host reads
  the previous step's routing, counts hits and misses, updates the eviction policy, and decides which missed experts
  to install in slots (admission: an expert must have been used more, recently, than the slot's victim: TinyLFU's
  rule over the layer-LRU victim, Einziger et al. 2017, so uniform routing does not pay PCIe twice for experts it
  never reuses). Then ONE host->device copy of the whole table on the compute stream (ahead of the step), and on
  the copy stream each layer's install copies followed by that layer's event. The step's layer ``l`` waits on event
  ``l`` (an external event: a wait node inside the captured graph) before its MoE launch, so installs overlap the
  earlier layers; a layer with no installs waits on its last, long completed, record.
* Safety: a slot is overwritten only after the step that last read it finished (the host plans after reading that
  step's tokens), and an evicted expert's entry points back at its bank row in the table the step reads (copied
  before the step on its own stream), so no launch of the next step reads a slot in the middle of its refill; a
  newly installed expert's entry is read only after its layer's event.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import numpy as np
import torch

log = logging.getLogger("ferrylm.experts")

#: decayed use count: each planned step multiplies every count by this, then adds the step's uses (half-life ~7 steps)
FREQ_DECAY = 0.9


@functools.cache
def _libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def device_address(t: torch.Tensor, device: torch.device) -> int | None:
    """The address at which a CUDA kernel on ``device`` reads the page-locked host tensor ``t`` (registered with
    ``cudaHostRegister`` or allocated pinned): ``cuMemHostGetDevicePointer``; None when it is not mapped (pageable
    memory, or no driver). On a CPU ``device`` (Triton's interpreter) the host address itself."""
    if device.type != "cuda":
        return t.data_ptr()
    lib = _libcuda()
    if lib is None:
        return None
    out = ctypes.c_uint64(0)
    fn = getattr(lib, "cuMemHostGetDevicePointer_v2", None) or lib.cuMemHostGetDevicePointer
    rc = fn(ctypes.byref(out), ctypes.c_void_p(t.data_ptr()), ctypes.c_uint(0))
    return int(out.value) if rc == 0 else None


class SlotTable:
    """The table, the routing recorder and the per-layer events of one offloading executor (module docstring).

    Args:
        bank_rows: MoE layer index -> its bank ``[E, S]`` host tensor (page-locked on CUDA).
        layout: the :class:`~ferrylm.experts.banks.ExpertLayout` of a row.
        device: the compute device.
        max_tokens: the largest step the table serves (tokens); larger steps take the host-planned or streamed paths.

    Raises:
        RuntimeError: a bank is not mapped into the device's address space (the caller then keeps the host-planned
            path).
    """

    def __init__(self, bank_rows: dict[int, torch.Tensor], layout, device: torch.device, max_tokens: int):
        self.layers = tuple(sorted(bank_rows))
        self.index = {layer: i for i, layer in enumerate(self.layers)}
        self.device = device
        self.layout = layout
        self.max_tokens = int(max_tokens)
        num_e = next(iter(bank_rows.values())).shape[0]
        self.num_experts = num_e
        cuda = device.type == "cuda"
        self.ref = torch.zeros(1, layout.numel, dtype=layout.row_dtype, device=device)  # offsets' origin
        self.views = layout.layer_views(self.ref)
        ref = self.ref.data_ptr()
        home = np.empty((len(self.layers), num_e), dtype=np.int64)
        for i, layer in enumerate(self.layers):
            rows = bank_rows[layer]
            base = device_address(rows, device)
            if base is None:
                raise RuntimeError(f"the expert bank of layer {layer} is not mapped for device reads")
            home[i] = base + np.arange(num_e, dtype=np.int64) * rows.stride(0) * rows.element_size() - ref
        self.home = home  # each expert's bank row (the table entry of an expert that is not in a slot)
        self.host = torch.from_numpy(home.copy())
        if cuda:
            self.host = self.host.pin_memory()
        self.host_np = self.host.numpy()
        self.table = self.host.to(device)
        self.routed: torch.Tensor | None = None       # [max_tokens, L, k] int64 device (made on the first step)
        self.routed_host: torch.Tensor | None = None  # its pinned host mirror
        self.routed_np: np.ndarray | None = None
        self.events = [torch.cuda.Event(external=True) for _ in self.layers] if cuda else []
        self.freq = np.zeros((len(self.layers), num_e), dtype=np.float32)
        self.recorded = 0  # tokens of the last step whose routing the mirror holds (0: none)
        self.dirty = False  # host table differs from the device's

    @property
    def nbytes(self) -> int:
        """Device bytes: the reference row, the table and the routing buffer."""
        return self.ref.nbytes + self.table.nbytes + (0 if self.routed is None else self.routed.nbytes)

    # --- what the step does (inside the graph) ---------------------------------------------------------------
    def layer_inputs(self, layer: int) -> tuple[int, torch.Tensor]:
        """``(table row index, [E] int64 offsets of the layer)``; waits (on the current stream) for the layer's
        installs of this step."""
        i = self.index[layer]
        if self.events:
            torch.cuda.current_stream(self.device).wait_event(self.events[i])
        return i, self.table[i]

    def record(self, i: int, topk_ids: torch.Tensor) -> None:
        """Keep layer row ``i``'s ``[T, k]`` routed ids; after the last MoE layer copy the step's ids to the host
        mirror (non-blocking: complete once the step's sampled tokens have been read)."""
        t, k = topk_ids.shape
        if self.routed is None or self.routed.shape[2] != k:  # the first (eager) step: before any graph capture
            self.routed = torch.zeros(self.max_tokens, len(self.layers), k, dtype=torch.int64, device=self.device)
            host = torch.zeros(self.max_tokens, len(self.layers), k, dtype=torch.int64)
            self.routed_host = host.pin_memory() if self.device.type == "cuda" else host
            self.routed_np = self.routed_host.numpy()
        self.routed[:t, i].copy_(topk_ids)
        if i == len(self.layers) - 1:
            self.routed_host[:t].copy_(self.routed[:t], non_blocking=self.device.type == "cuda")

    # --- between steps (host) --------------------------------------------------------------------------------
    def set_slot(self, layer: int, expert: int, offset: int) -> None:
        """Expert ``(layer, expert)`` now lives at byte ``offset`` from ``ref`` (a slot row)."""
        self.host_np[self.index[layer], expert] = offset
        self.dirty = True

    def set_home(self, layer: int, expert: int) -> None:
        """Expert ``(layer, expert)`` is read from its bank row again (evicted)."""
        i = self.index[layer]
        self.host_np[i, expert] = self.home[i, expert]
        self.dirty = True

    def reset(self, slot_offsets: dict[tuple[int, int], int]) -> None:
        """Rebuild the whole table from ``(layer, expert) -> slot byte offset`` (after the cache was changed by a
        path that does not keep the table: a reserve, a shrink, a host-planned step)."""
        self.host_np[:] = self.home
        for (layer, e), off in slot_offsets.items():
            self.host_np[self.index[layer], e] = off
        self.dirty = True

    def take_routing(self) -> np.ndarray | None:
        """The last recorded step's routed ids ``[T, L, k]`` (a copy), or None; clears it."""
        t, self.recorded = self.recorded, 0
        return None if t == 0 or self.routed_np is None else self.routed_np[:t].copy()

    def decay(self, ids: np.ndarray) -> None:
        """Age the use counts and add one step's uses (``ids [T, L, k]``), per layer and expert."""
        self.freq *= FREQ_DECAY
        lay = np.broadcast_to(np.arange(ids.shape[1])[None, :, None], ids.shape)
        used = np.zeros_like(self.freq, dtype=bool)
        used[lay.reshape(-1), ids.reshape(-1)] = True
        self.freq += used

    def publish(self, copier, installs: dict[int, list[tuple[int, torch.Tensor, torch.Tensor, object]]]) -> None:
        """Send the table (when changed) on the current stream, ahead of the step that reads it, and each layer's
        install copies ``(slot, dst slot row, src bank row, after)`` on the copy engine, recording the layer's event
        after them (CUDA; a layer without installs keeps its last, completed, record). On the CPU the copies are
        waited for here."""
        if self.dirty:
            self.table.copy_(self.host, non_blocking=self.device.type == "cuda")
            self.dirty = False
        if not installs:
            return
        with copier.batch():
            for layer, items in installs.items():
                for _, dst, src, after in items:
                    copier.copy(dst, src, after=after)
                if self.events:
                    self.events[self.index[layer]].record(copier.stream)
        if not self.events:
            copier.synchronize()
