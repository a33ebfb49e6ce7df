"""The native kernels' dense entry (experts/cpu_kernel.py ``BlockMatrix``, ``matmul``, ``gather``): a GGUF's
non-expert matrices computed from their GGML blocks where they lie. Rows against gguf-py's dequantization bit for
bit; products against float64 on those rows and the activation as the kernel quantizes it, for every block kind and
instruction set, odd token counts (past a token tile) and odd segment row counts."""

from __future__ import annotations

import pytest
import torch

from ferrylm.experts.cpu_kernel import ISAS
from ferrylm.experts.native_layouts import BlockMatrix
from tests.experts.helpers import kernel_isa
from ferrylm.experts.gguf_blocks import BLOCK_TYPES, fill_random_blocks

gguf = pytest.importorskip("gguf")

KINDS = ("q8_0", "q4_k", "q5_k", "q6_k")


def _blocks(kind: str, n: int, k: int, seed: int) -> torch.Tensor:
    bt = BLOCK_TYPES[kind]
    data = torch.empty(n, k // bt.elems * bt.nbytes, dtype=torch.uint8)
    fill_random_blocks(data, kind, generator=torch.Generator().manual_seed(seed), std=k ** -0.5)
    return data


def _oracle(kind: str, data: torch.Tensor) -> torch.Tensor:
    """gguf-py's dequantization (ggml's) of uint8 rows -> float32 ``[N, K]``."""
    qtype = getattr(gguf.GGMLQuantizationType, BLOCK_TYPES[kind].name)
    return torch.from_numpy(gguf.quants.dequantize(data.numpy(), qtype).copy())


def _as_quantized(k, x: torch.Tensor, kind: str) -> torch.Tensor:
    """``x`` as the kernels see it against ``kind`` rows (``q * d``): 8 bits per 32 inputs, per 256 for the K-quants
    (ggml's Q8_K)."""
    block = 32 if kind == "q8_0" else 256
    q, d = k.quantize_activation(x, block)
    return (q.double().view(x.shape[0], -1, block) * d.double()[..., None]).view(x.shape[0], -1)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 3, 7, 70])
def test_matmul_over_segments_is_exact_on_the_quantized_activation(kernel, isa, kind, m):
    """Three segments of odd row counts (a fused q|k|v read where its parts lie), the first of ``kind``, then Q6_K
    and Q8_0: ``x @ W.T`` against float64 on gguf-py's rows and ``q * d`` (the activation as quantized), float32
    accumulation only; and against the float activation within the 8-bit rounding."""
    k_in = 512
    kinds = (kind, "q6_k", "q8_0")
    segs = [_blocks(kd, n, k_in, seed) for seed, (kd, n) in enumerate(zip(kinds, (33, 5, 70)))]
    k = kernel_isa(kernel, isa)
    m_ = BlockMatrix.stacked([BlockMatrix(kd, k_in, s) for kd, s in zip(kinds, segs)])
    assert (m_.n, m_.k, m_.kinds) == (108, k_in, kinds) and m_.nbytes == sum(s.numel() for s in segs)
    x = torch.randn(m, k_in, generator=torch.Generator().manual_seed(m))
    got = k.matmul(x, m_, threads=2)
    assert got.shape == (m, 108) and got.dtype == torch.float32
    ref = torch.cat([_as_quantized(k, x, kd) @ _oracle(kd, s).double().T for kd, s in zip(kinds, segs)], dim=1)
    assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-5
    full = x.double() @ torch.cat([_oracle(kd, s) for kd, s in zip(kinds, segs)]).double().T
    assert ((got.double() - full).norm() / full.norm()).item() < 2e-2


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("k_in", [96, 160])
def test_q8_0_rows_of_an_odd_block_count(kernel, isa, k_in):
    """Q8_0 rows of an odd number of 32-input blocks (the 512-bit path reads two blocks a step; these rows end on a
    single one): exact on the quantized activation, for 1 to 20 tokens (the 16-token lanes from 8 on)."""
    data = _blocks("q8_0", 41, k_in, 4)
    k = kernel_isa(kernel, isa)
    for m in (1, 5, 9, 20):
        x = torch.randn(m, k_in, generator=torch.Generator().manual_seed(m))
        got = k.matmul(x, BlockMatrix("q8_0", k_in, data), threads=2)
        ref = _as_quantized(k, x, "q8_0") @ _oracle("q8_0", data).double().T
        assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", KINDS)
def test_gathered_rows_equal_gguf_dequantize(kernel, isa, kind):
    """Embedding rows: any order, repeats, an odd count; bit for bit gguf-py's rows."""
    data = _blocks(kind, 37, 256, 3)
    k = kernel_isa(kernel, isa)
    m = BlockMatrix(kind, 256, data)
    ids = torch.tensor([5, 0, 36, 5, 17])
    assert torch.equal(k.gather(m, ids), _oracle(kind, data)[ids])
    assert k.gather(m, torch.tensor([], dtype=torch.int64)).shape == (0, 256)
    with pytest.raises(ValueError, match="bad arguments"):
        k.gather(m, torch.tensor([37]))
    with pytest.raises(ValueError, match="one-segment"):
        k.gather(BlockMatrix.stacked([m, m]), ids)


def test_threads_and_isas_agree(kernel):
    """The same product from 1 and 3 threads, and from each instruction set this CPU runs, bit for bit (each
    output is one row's dot product, whoever computes it)."""
    data = _blocks("q4_k", 200, 512, 9)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(2))
    m = BlockMatrix("q4_k", 512, data)
    want = kernel.matmul(x, m, threads=1)
    assert torch.equal(kernel.matmul(x, m, threads=3), want)
    for isa in ISAS[:ISAS.index(kernel.isa) + 1]:
        got = kernel.with_isa(isa).matmul(x, m, threads=2)
        assert ((got - want).norm() / want.norm()).item() < 1e-6, isa


@pytest.mark.parametrize("make, match", [
    (lambda: BlockMatrix("q4_0", 256, torch.zeros(1, 144, dtype=torch.uint8)), "one of q8_0"),
    (lambda: BlockMatrix("q4_k", 100, torch.zeros(1, 144, dtype=torch.uint8)), "multiple of 256"),
    (lambda: BlockMatrix("q4_k", 256, torch.zeros(1, 145, dtype=torch.uint8)), r"uint8 \[rows, 144\]"),
    (lambda: BlockMatrix("q8_0", 32, torch.zeros(4, 68, dtype=torch.uint8)[:, :34]), "contiguous rows"),
    (lambda: BlockMatrix.stacked([BlockMatrix("q8_0", 32, torch.zeros(1, 34, dtype=torch.uint8)),
                                  BlockMatrix("q8_0", 64, torch.zeros(1, 68, dtype=torch.uint8))]), "share K"),
])
def test_bad_matrices_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_activations_are_refused(kernel):
    m = BlockMatrix("q8_0", 64, _blocks("q8_0", 3, 64, 1))
    for x in (torch.zeros(2, 32), torch.zeros(0, 64), torch.zeros(64)):
        with pytest.raises(ValueError, match=r"host \[M >= 1, 64\]"):
            kernel.matmul(x, m, threads=1)
    with pytest.raises(ValueError, match="threads"):
        kernel.matmul(torch.zeros(1, 64), m, threads=0)
