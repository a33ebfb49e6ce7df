"""The offloading backends' device-side expert table: one fused MoE launch per layer, hits and misses alike, with no
host decision inside a decode step (so the whole step is one CUDA graph).

Protocol (docs/ARCHITECTURE.md, "Offload decode"):

* Every routed expert ``(layer, e)`` has an address in ``table [L, E + 1]`` (int64, device; column ``E`` is
  scratch): the BYTE offset of its row from ``ref`` (a one-row device tensor whose views the kernel is launched
  with). An expert in a cache slot points at the slot's row; any other expert points at its host bank row,
  page-locked and mapped into the device's address space.
* Inside the step, before each MoE layer's launch, :class:`~ferrylm.experts.device_pools.DevicePools` installs the
  layer's missed experts into its slot pool (the GPU copies the rows from the mapped banks) and updates the table;
  ``fused_moe(..., row_offset=table[l, :E])`` then reads them from device memory.
* The graph records each MoE layer's routed ids into ``routed [B, L, k]`` and copies them to a pinned host mirror at
  the end of the step (the engine reads the sampled tokens after every step, so the mirror is complete by then): the
  host counts hits and misses from it between steps.
* Between steps the host brings its :class:`~ferrylm.experts.cache.SlotCache` in step with the device's installs;
  when a host path changed the cache, the table and the pools are rebuilt from it (:meth:`SlotTable.reset`).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import numpy as np
import torch

log = logging.getLogger("ferrylm.experts")

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
        layout: the :class:`~ferrylm.experts.executor.ExpertLayout` of a row.
        device: the compute device.
        max_tokens: the largest step the table serves (tokens); larger steps take the host-planned or streamed paths.

    Attributes:
        host_np: the table as last built on the host (:meth:`reset`); the device's installs change only the device
            copy.

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
        host = np.zeros((len(self.layers), num_e + 1), dtype=np.int64)
        host[:, :num_e] = home
        self.host = torch.from_numpy(host)
        if cuda:
            self.host = self.host.pin_memory()
        self.host_np = self.host.numpy()
        self.table = self.host.to(device)
        self.routed: torch.Tensor | None = None       # [max_tokens, L, k] int64 device (made on the first step)
        self.routed_host: torch.Tensor | None = None  # its pinned host mirror
        self.routed_np: np.ndarray | None = None
        self.recorded = 0  # tokens of the last step whose routing the mirror holds (0: none)
        self.dirty = False  # host table differs from the device's

    @property
    def nbytes(self) -> int:
        """Device bytes: the reference row, the table and the routing buffer."""
        return self.ref.nbytes + self.table.nbytes + (0 if self.routed is None else self.routed.nbytes)

    # --- what the step does (inside the graph) ---------------------------------------------------------------
    def layer_inputs(self, layer: int) -> tuple[int, torch.Tensor]:
        """``(table row index, [E] int64 offsets of the layer)``: a view the layer's installs update in place."""
        i = self.index[layer]
        return i, self.table[i, :self.num_experts]

    def record(self, i: int, topk_ids: torch.Tensor) -> None:
        """Keep layer row ``i``'s ``[T, k]`` routed ids; after the last MoE layer copy the step's ids to the host
        mirror (non-blocking: complete once the step's sampled tokens have been read)."""
        t, k = topk_ids.shape
        if self.routed is None or self.routed.shape[2] != k:  # the first (eager) step: before any graph capture
            shape = (self.max_tokens, len(self.layers), k)
            self.routed, self.routed_host = self._buffer(shape)
            self.routed_np = self.routed_host.numpy()
        self.routed[:t, i].copy_(topk_ids)
        if i == len(self.layers) - 1:  # a contiguous device->host copy into pinned memory: capturable
            self.routed_host[:t].copy_(self.routed[:t], non_blocking=self.device.type == "cuda")

    def _buffer(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """A zeroed int64 device buffer and its host mirror (pinned on CUDA)."""
        host = torch.zeros(shape, dtype=torch.int64)
        return (torch.zeros(shape, dtype=torch.int64, device=self.device),
                host.pin_memory() if self.device.type == "cuda" else host)

    # --- between steps (host) --------------------------------------------------------------------------------
    def reset(self, slot_offsets: dict[tuple[int, int], int]) -> None:
        """Rebuild the whole table from ``(layer, expert) -> slot byte offset`` (after the cache was changed by a
        path that does not keep the table: a reserve, a shrink, a host-planned step)."""
        self.host_np[:, :self.num_experts] = self.home
        for (layer, e), off in slot_offsets.items():
            self.host_np[self.index[layer], e] = off
        self.dirty = True

    def take_routing(self) -> np.ndarray | None:
        """The last recorded step's routed ids ``[T, L, k]`` (a copy), or None; clears it."""
        t, self.recorded = self.recorded, 0
        if t == 0 or self.routed_np is None:
            return None
        return self.routed_np[:t].copy()

    def publish(self) -> None:
        """Send the table (when rebuilt) on the current stream, ahead of the step that reads it."""
        if self.dirty:
            self.table.copy_(self.host, non_blocking=self.device.type == "cuda")
            self.dirty = False
