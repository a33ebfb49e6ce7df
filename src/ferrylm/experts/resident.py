"""The resident backend: every routed expert of every MoE layer sits on the compute device.

On CUDA (with Triton) every step runs the fused MoE kernels (``experts/kernels/fused_moe.py``): tokens grouped by
expert on the device, two grouped GEMM kernels over all of the layer's experts, no host sync and no Python loop over
experts, so a decode step is captured whole in one CUDA graph (``graph_safe``). Elsewhere (the CPU, the reference):
decode steps are planned on the host from the step's expert ids (one device->host read per layer); larger steps
group the tokens by expert on the device (one sync for the counts) and run one GEMM chain per active expert; the
weighted results are summed per token (:mod:`ferrylm.experts.work`, shared with every other backend). On the CPU the
native kernels (:mod:`ferrylm.experts.cpu_kernel`, given as ``native``) compute a layer's active experts in one call,
reading quantized stacks where they lie (a GGUF's mapped blocks included) instead of dequantizing them every step.
"""

from __future__ import annotations

import functools

import torch

from ferrylm.experts.cpu_kernel import NativeExpertKernel
from ferrylm.experts.executor import ExpertExecutor, LayerExperts
from ferrylm.experts.stats import ExpertReport, ExpertStats
from ferrylm.experts.work import ExpertGroups, LayerWork, group_by_expert, is_small_step, swiglu_expert

@functools.cache
def fused_available() -> bool:
    """Triton imports (the fused MoE kernels can run on a CUDA device)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = ["ExpertGroups", "ResidentExecutor", "group_by_expert", "run_grouped", "swiglu_expert"]


def run_grouped(experts: LayerExperts, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, groups: ExpertGroups | None = None) -> torch.Tensor:
    """``sum_j w[t, j] * expert_{ids[t, j]}(x[t])`` for one layer whose experts are all on ``hidden``'s device.

    Args:
        experts: the layer's stacked weights, on ``hidden``'s device.
        hidden: ``[T, H]``; topk_ids: ``[T, k]`` int64; topk_weights: ``[T, k]``.
        groups: the assignments already grouped (:func:`group_by_expert`), or None to group them here.

    Returns:
        ``[T, H]`` in ``hidden``'s dtype (see :class:`~ferrylm.experts.work.LayerWork` for the summation order).
    """
    if hidden.shape[0] == 0:
        return torch.zeros_like(hidden)
    return _work(experts, hidden, topk_ids, topk_weights, groups).combine()


def _work(experts: LayerExperts, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
          groups: ExpertGroups | None = None, layer: int = -1) -> LayerWork:
    if hidden.shape[0] == 0:
        raise ValueError("empty step")
    if groups is None and is_small_step(hidden.shape[0]):
        work = LayerWork.from_host_ids(layer, hidden, topk_ids, topk_weights, topk_ids.tolist(),
                                       experts.num_experts, math=experts.math)
    else:
        if groups is None:
            groups = group_by_expert(topk_ids, topk_weights, experts.num_experts)
        work = LayerWork(layer, hidden, topk_ids, groups, math=experts.math)
    work.compute(work.needed, experts, work.needed)
    return work


class ResidentExecutor(ExpertExecutor):
    """All experts resident on one device; see :func:`run_grouped`.

    Args:
        layers: decoder layer index -> that layer's :class:`LayerExperts` (already on the compute device).
        native: the CPU's native expert kernel (quantized host stacks it reads go through it), or None.
        threads: its OpenMP threads (default: torch's intra-op threads).
    """

    name = "resident"

    def __init__(self, layers: dict[int, LayerExperts], native: NativeExpertKernel | None = None,
                 threads: int | None = None):
        self.layers = dict(layers)
        self.native = native
        self.threads = threads or torch.get_num_threads()
        # the layers the native kernel computes, with where their stacks lie (found once)
        self._native_rows = {i: native.stack_rows(le) for i, le in self.layers.items()
                             if native is not None and le.quant is not None and native.reads_stacks(le)}
        self.counters = ExpertStats(tuple(sorted(self.layers)))
        self._used: torch.Tensor | None = None  # fused path: distinct experts used, counted on the device

    @property
    def graph_safe(self) -> bool:
        """True when every step runs the fused kernels (experts on CUDA, Triton importable): no host decision or
        sync inside a step, so whole decode steps can be captured in a CUDA graph."""
        first = next(iter(self.layers.values()), None)
        return first is not None and first.gate.is_cuda and fused_available()

    @property
    def expert_bytes(self) -> int:
        first = next(iter(self.layers.values()), None)
        return first.expert_bytes if first is not None else 0

    def count_replayed_step(self, num_tokens: int) -> None:
        """See :meth:`ExpertExecutor.count_replayed_step` (the distinct experts were counted on the device by the
        graph)."""
        self.counters.open_step(num_tokens)

    def run(self, layer_idx: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
            ids_and_predicted: torch.Tensor | None = None, stage=None) -> torch.Tensor:
        """See :meth:`ExpertExecutor.run` (no prefetch, no staging: both keywords are ignored). Raises KeyError for
        a layer without experts."""
        experts = self.layers.get(layer_idx)
        if experts is None:
            raise KeyError(f"layer {layer_idx} has no routed experts (MoE layers: {sorted(self.layers)})")
        if self.counters.starts_step(layer_idx):
            self.counters.open_step(hidden.shape[0])
        if hidden.shape[0] == 0:
            return torch.zeros_like(hidden)
        if hidden.is_cuda and fused_available():
            from ferrylm.experts.kernels.fused_moe import fused_moe

            if self._used is None:
                self._used = torch.zeros((), dtype=torch.int64, device=hidden.device)
            return fused_moe(hidden, experts.gate, experts.up, experts.down, topk_ids, topk_weights,
                             used_experts=self._used, math=experts.math)
        rows = self._native_rows.get(layer_idx)
        if rows is not None:
            used, out = self.native.run_routed(hidden, rows, topk_ids, topk_weights, self.threads)
            out = out.to(hidden.dtype)   # grouped by expert in C, each token's outputs summed in ascending id
        else:
            work = _work(experts, hidden, topk_ids, topk_weights, layer=layer_idx)
            used, out = len(work.needed), work.combine()
        self.counters.step.needed += used
        self.counters.step.hits += used
        return out

    def close(self) -> None:
        """Drop the device copies of the experts."""
        self.layers = {}
        self._native_rows = {}

    def stats(self) -> ExpertReport:
        """Steps, tokens and experts used (every one a hit: all are resident)."""
        report = self.counters.snapshot(self.name, {}, {})
        if self._used is not None:  # fused path: one small device read, off the hot path (stats / heartbeats)
            used = int(self._used.item())
            report.totals.needed += used
            report.totals.hits += used
        return report
