"""Shared helpers for tests/experts: a one-sequence KV cache, a greedy trace through a model, model loading with a
given expert backend."""

from __future__ import annotations

import pytest
import torch

from ferrylm.experts import Bandwidths, ExpertOptions
from ferrylm.models.reference_attention import SequenceCacheAttention

# Bandwidths for the hybrid split in tests: B_cpu_eff = min(1, 3 - 1) = 1 = B_pcie, so half the misses are fetched.
TEST_BANDWIDTHS = Bandwidths(pcie=1.0, host=3.0, cpu=1.0, hbm=10.0)


def greedy_trace(model, prompt: list[int], new_tokens: int, chunks: tuple[int, ...] = (7,)
                 ) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill ``prompt`` in chunks split at ``chunks``, then decode ``new_tokens`` greedily one token per step.

    Returns:
        (generated ids, the logits ``[V]`` each generated id was taken from).
    """
    cache = SequenceCacheAttention()
    bounds = [0, *[c for c in chunks if 0 < c < len(prompt)], len(prompt)]
    logits = None
    with torch.inference_mode():
        for lo, hi in zip(bounds, bounds[1:]):
            ids = torch.tensor(prompt[lo:hi])
            hidden = model(ids, torch.arange(lo, hi), cache)
            logits = model.compute_logits(hidden[-1:])[0]
        out, trace = [], []
        pos = len(prompt)
        for _ in range(new_tokens):
            tok = int(torch.argmax(logits))
            out.append(tok)
            trace.append(logits)
            hidden = model(torch.tensor([tok]), torch.tensor([pos]), cache)
            logits = model.compute_logits(hidden)[0]
            pos += 1
    return out, trace


def options(backend: str, cache_size: int | None, **kw) -> ExpertOptions:
    """Test options: fixed hybrid bandwidths, the given cache size."""
    return ExpertOptions(backend=backend, cache_size=cache_size, bandwidths=TEST_BANDWIDTHS, **kw)


def exact_options() -> ExpertOptions:
    """Resident experts computed by dequantize-then-GEMM on a CPU (``--moe-cpu-kernel torch``): logits equal a
    float32 reference to rounding, for parity tests against the format's own dequantizer."""
    return ExpertOptions(backend="resident", cpu_kernel="torch")


# The native CPU kernels' integer kinds (int4, int8, fp4, GGML blocks) read 8-bit activations (each input rounded
# by up to 1/254 of its 32-block's largest magnitude, as ggml's CPU backend does), so the backends that compute
# experts on the CPU agree with dequantize-then-GEMM to this relative error, the others to float32 rounding.
CPU_QUANT_REL_TOL = 5e-2


def assert_backend_close(backend: str, got: torch.Tensor, want: torch.Tensor, label: object = None) -> None:
    """``got`` equals ``want`` within 1e-5 (absolute), or within CPU_QUANT_REL_TOL (relative norm) for the
    backends that compute quantized experts on the CPU (``cpu``, ``hybrid``, and ``resident`` on a CPU device, whose
    GGML-block stacks the native kernels read)."""
    if backend in ("cpu", "hybrid") or (backend == "resident" and not got.is_cuda):
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert err < CPU_QUANT_REL_TOL, (backend, label, err)
    else:
        assert (got - want).abs().max().item() <= 1e-5, (backend, label)


def kernel_isa(kernel, isa: str):
    """``kernel`` calling its ``isa`` kernels; skips the test on a CPU without that instruction set."""
    try:
        return kernel.with_isa(isa)
    except ValueError as e:
        pytest.skip(str(e))
