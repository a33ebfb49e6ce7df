"""Host expert banks: every routed expert of every MoE layer in host memory, one contiguous row per expert.

Layout: per MoE layer one ``[E, S]`` tensor, ``S = 3 * I * H`` elements; row ``e`` holds expert ``e`` as
``gate [I, H] | up [I, H] | down [H, I]`` (row-major each); quantized experts are byte rows of their stored
fields (:class:`~ferrylm.experts.executor.ExpertLayout`), so banks, slots and copies hold and move quantized bytes. One copy of one row moves one whole expert, and
``gate | up`` is a single ``[2I, H]`` block. A device slot is a row of the same shape.

Pinning: host→device copies from page-locked memory run at full PCIe speed, from pageable memory at about a third,
because the driver stages them through a bounce buffer.
The banks are allocated pageable and then page-locked in place with ``cudaHostRegister`` layer by layer (PyTorch's
pinned allocator rounds allocations up to a power of two, which would waste up to half the host memory). When
registration fails (no CUDA, locked-memory limits) the banks stay pageable and a warning states the cost.
"""

from __future__ import annotations

import logging
import sys
import weakref

import torch

from ferrylm.experts.executor import ExpertLayout, LayerExperts

log = logging.getLogger("ferrylm.experts")

PAGEABLE_WARNING = ("expert banks are in pageable host memory (not page-locked: %s); host->device expert "
                    "copies run at roughly a third of pinned speed (about 19 vs 55 GB/s measured on an H200 "
                    "host), so offloading backends will be slower")


def _cudart():
    return torch.cuda.cudart() if torch.cuda.is_available() else None


def register_host_memory(t: torch.Tensor) -> str | None:
    """Page-lock the CPU tensor ``t``'s memory in place (``cudaHostRegister``). Returns None on success, else
    why it failed (no CUDA, or the CUDA error)."""
    rt = _cudart()
    if rt is None:
        return "CUDA is not available"
    if t.device.type != "cpu" or not t.is_contiguous():
        return "not a contiguous CPU tensor"
    err = rt.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    code = int(getattr(err, "value", err))
    if code != 0:
        return f"cudaHostRegister error {code}"
    return None


def _common_layout(layers: dict[int, LayerExperts]) -> tuple[ExpertLayout, int]:
    """The row layout and expert count every layer shares. Raises ValueError: no layers, or two that differ."""
    if not layers:
        raise ValueError("no MoE layers to bank")
    first = next(iter(layers.values()))
    layout, e = ExpertLayout.of(first), first.num_experts
    for idx, le in layers.items():
        if ExpertLayout.of(le) != layout or le.num_experts != e:
            raise ValueError(f"MoE layer {idx} has experts of another shape or dtype than layer {next(iter(layers))}")
    return layout, e


def _over_pin_budget(total: int, on_host: bool, budget_bytes: int | None) -> str | None:
    """Why banks of ``total`` bytes must stay pageable (they exceed the pin budget), or None."""
    budget, why = (budget_bytes, f"{budget_bytes / 2**30:.2f} GiB given") if budget_bytes is not None \
        else pin_budget(total, on_host)
    if total > budget:
        return f"the banks' {total / 2**30:.2f} GiB exceed the host's pin budget of {why}; nothing was page-locked"
    return None


def _unregister(ptrs: list[int]) -> None:
    rt = _cudart()
    if rt is None:
        return
    for p in ptrs:
        rt.cudaHostUnregister(p)


PIN_KEEP_FRACTION = 0.10   # of host RAM never page-locked (the OS, the frontend, the tokenizer, page cache)
PIN_KEEP_MIN = 4 << 30


def pin_budget(bank_bytes: int, stacks_on_host: bool) -> tuple[int, str]:
    """``(bytes, why)``: how much of the host ferrylm may page-lock for the banks now. Host RAM less what others
    use and less ``max(4 GiB, 10 %)`` kept pageable; the experts' stacks being packed count as ours when they
    are already in host memory (packing turns them into the banks). Page-locking past it fails half-way
    (``cudaHostRegister``) or starves the host."""
    import psutil

    vm = psutil.virtual_memory()
    keep = max(PIN_KEEP_MIN, int(PIN_KEEP_FRACTION * vm.total))
    used_by_others = max(0, int(vm.total - vm.available) - (bank_bytes if stacks_on_host else 0))
    budget = max(0, int(vm.total) - keep - used_by_others)
    return budget, (f"{budget / 2**30:.2f} GiB = {vm.total / 2**30:.2f} GiB host RAM - {used_by_others / 2**30:.2f} "
                    f"GiB used by others - {keep / 2**30:.2f} GiB kept pageable")


def probe_pinning() -> str | None:
    """Try to page-lock a small buffer. None when pinning works here, else the reason it does not."""
    t = torch.empty(1 << 20, dtype=torch.uint8)
    why = register_host_memory(t)
    if why is None:
        _unregister([t.data_ptr()])
    return why


class HostBanks:
    """All routed experts in host memory, packed one row per expert (see the module docstring).

    Args:
        packed: MoE layer index -> ``[E, S]`` CPU tensor.
        layout: the row layout.
        pinned: whether the rows are page-locked.

    Build it with :meth:`from_layers`.
    """

    def __init__(self, packed: dict[int, torch.Tensor], layout: ExpertLayout, pinned: bool,
                 registered: list[int] | None = None, math: dict | None = None):
        if not packed:
            raise ValueError("HostBanks needs at least one MoE layer")
        self.packed = dict(sorted(packed.items()))
        self._row_views: dict[int, tuple[torch.Tensor, ...]] = {}
        self.layout = layout
        self.pinned = pinned
        self.num_experts = next(iter(self.packed.values())).shape[0]
        self.math = dict(math or {})  # layer -> ExpertMath (gpt-oss: biases + clamped SwiGLU; small, kept apart)
        if registered:
            weakref.finalize(self, _unregister, list(registered))

    @classmethod
    def from_layers(cls, layers: dict[int, LayerExperts], *, pin: bool | None = None,
                    progress: bool | None = None, pin_budget_bytes: int | None = None) -> "HostBanks":
        """Pack ``layers`` into host rows, layer by layer, and page-lock them.

        The given :class:`LayerExperts` objects are rewritten in place to views of the packed rows, so their
        original stacks are freed as packing goes (peak host memory: the banks plus one layer).

        Args:
            layers: MoE layer -> stacked experts (any device; all layers the same shape and dtype).
            pin: page-lock (default: when CUDA is available). On failure: pageable, with a warning.
            progress: show a progress bar (default: when stderr is a terminal and the banks exceed 1 GiB).
            pin_budget_bytes: what may be page-locked (default: :func:`pin_budget`, probed before pinning):
                banks larger than it stay pageable from the start, with a warning stating the cost.

        Raises:
            ValueError: no layers, or layers of different shapes / dtypes.
        """
        layout, e = _common_layout(layers)
        first = next(iter(layers.values()))
        want_pin = torch.cuda.is_available() if pin is None else pin
        total = len(layers) * e * layout.nbytes
        if progress is None:
            progress = sys.stderr.isatty() and total > (1 << 30)
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(layers), desc="expert banks", unit="layer", file=sys.stderr)
        packed: dict[int, torch.Tensor] = {}
        registered: list[int] = []
        pin_error = None if want_pin else "not requested"
        if want_pin:   # probe the budget first: never fail half-way through the load, never starve the host
            pin_error = _over_pin_budget(total, first.gate.device.type == "cpu", pin_budget_bytes)
        for idx in sorted(layers):
            le = layers[idx]
            rows = torch.empty(e, layout.numel, dtype=layout.row_dtype)
            layout.pack(rows, le)
            views = layout.layer_views(rows)
            le.gate, le.up, le.down = views.gate, views.up, views.down  # frees the caller's stacks
            if pin_error is None:
                pin_error = register_host_memory(rows)
                if pin_error is None:
                    registered.append(rows.data_ptr())
            packed[idx] = rows
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        pinned = bool(registered) and len(registered) == len(packed)
        if want_pin and not pinned:
            log.warning(PAGEABLE_WARNING, pin_error)
            if registered:  # a later layer failed: keep it uniform
                _unregister(registered)
                registered = []
        log.info("expert banks: %d layers x %d experts x %.1f MiB = %.2f GiB in %s host memory", len(packed), e,
                 layout.nbytes / 2**20, total / 2**30, "pinned" if pinned else "pageable")
        math = {i: le.math for i, le in layers.items() if le.math is not None}
        return cls(packed, layout, pinned, registered, math)

    @property
    def layers(self) -> tuple[int, ...]:
        """MoE layer indices, ascending."""
        return tuple(self.packed)

    def __contains__(self, layer: int) -> bool:
        return layer in self.packed

    def row(self, layer: int, expert: int) -> torch.Tensor:
        """Expert ``expert`` of ``layer`` as one ``[S]`` row (a view)."""
        views = self._row_views.get(layer)
        if views is None:  # one unbind per layer instead of one select per copy (host time on the hot path)
            views = self._row_views[layer] = self.packed[layer].unbind(0)
        return views[expert]

    def rows(self, layer: int, lo: int, hi: int) -> torch.Tensor:
        """Experts ``lo .. hi - 1`` of ``layer`` as ``[hi - lo, S]`` (a view: one contiguous span of the bank)."""
        return self.packed[layer][lo:hi]

    def layer_experts(self, layer: int) -> LayerExperts:
        """``layer``'s experts as stacked views (for the resident path), with the layer's :class:`ExpertMath`."""
        views = self.layout.layer_views(self.packed[layer])
        views.math = self.math.get(layer)
        return views

    @property
    def expert_bytes(self) -> int:
        return self.layout.nbytes

    @property
    def total_bytes(self) -> int:
        return len(self.packed) * self.num_experts * self.layout.nbytes
