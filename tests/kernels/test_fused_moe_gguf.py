"""The fused MoE kernels on GGML block experts kept as the file's bytes (Q4_K, Q5_K, Q6_K, Q8_0; gate/up and down of
different types, as llama.cpp's Q4_K_M mixes them) against dequantize-then-matmul over the torch reference
(``experts.resident.run_grouped``): resident stacks and slot-cache byte rows through ``slot_of``, decode and prefill
tiles (a K tile inside one 256-element super-block, and Q8_0's 32-element blocks several to a tile). CPU: Triton's
interpreter in float32; GPU: bfloat16."""

from __future__ import annotations

import pytest
import torch

from ferrylm.experts.executor import ExpertLayout
from ferrylm.experts.executor import LayerExperts
from ferrylm.experts.quantized import ExpertQuant, block_format, mix_format, random_quant
from ferrylm.experts.resident import run_grouped
from tests.kernels.interp import kernel_device, load_kernels

FORMATS = {
    "Q4_K/Q6_K": ExpertQuant(block_format("Q4_K"), block_format("Q6_K")),
    "Q6_K/Q4_K": ExpertQuant(block_format("Q6_K"), block_format("Q4_K")),
    "Q8_0": ExpertQuant(block_format("Q8_0"), block_format("Q8_0")),
    "Q5_K/Q8_0": ExpertQuant(block_format("Q5_K"), block_format("Q8_0")),
    "Q4_K/kmix": ExpertQuant(block_format("Q4_K"), mix_format(["Q4_K", "Q6_K"])),  # Q4_K_M's mixed downs
}


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("t,slots", [(3, False), (2, True), (40, True)],
                         ids=["decode", "decode-slots", "prefill-slots"])
def test_block_fused_moe_matches_dequantize_then_matmul(name, t, slots):
    m = load_kernels("ferrylm.experts.kernels.fused_moe")
    dev = kernel_device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    e, k, h, i = 4, 2, 256, 256
    q = FORMATS[name]
    gen = torch.Generator().manual_seed(t + len(name))
    le = LayerExperts(gate=random_quant(q.gate_up, (e,), i, h, generator=gen, std=h ** -0.5, dtype=dtype),
                      up=random_quant(q.gate_up, (e,), i, h, generator=gen, std=h ** -0.5, dtype=dtype),
                      down=random_quant(q.down, (e,), h, i, generator=gen, std=i ** -0.5, dtype=dtype))
    x = torch.randn(t, h, generator=gen).to(dtype)
    w, ids = torch.topk(torch.randn(t, e, generator=gen).softmax(-1), k)
    ref = run_grouped(le, x, ids, w).double()
    x, ids, w = x.to(dev), ids.to(dev), w.to(dev)
    if slots:
        lay = ExpertLayout.of(le)
        packed = torch.zeros(e + 3, lay.numel, dtype=lay.row_dtype)
        where = torch.randperm(e + 3, generator=gen)[:e]
        rows = torch.zeros(e, lay.numel, dtype=lay.row_dtype)
        lay.pack(rows, le)
        packed[where] = rows
        v = lay.layer_views(packed.to(dev))
        out = m.fused_moe(x, v.gate, v.up, v.down, ids, w, slot_of=where.to(dev, torch.int32))
    else:
        d = le.to(dev)
        out = m.fused_moe(x, d.gate, d.up, d.down, ids, w)
    assert out.dtype == dtype and out.shape == (t, h)
    rel = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    assert rel < (2e-2 if dtype == torch.bfloat16 else 1e-5), rel


def _tile_kernel():
    """A kernel writing ``weight_tile``'s tiles of a whole ``[E, N, K]`` projection (module globals: the jit
    resolves ``tl`` and ``weight_tile`` there, imported only once Triton may be)."""
    import triton
    import triton.language as tl

    from ferrylm.experts.kernels.dequant import weight_tile

    globals().update(tl=tl, weight_tile=weight_tile)

    @triton.jit
    def tile_kernel(w_ptr, s_ptr, out_ptr, N, K, swe, swn, swk, sse, QKIND: tl.constexpr, GROUP: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        pk = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = pk * BLOCK_K + tl.arange(0, BLOCK_K)
        e = tl.program_id(2).to(tl.int64)
        wt = weight_tile(w_ptr, s_ptr, w_ptr, w_ptr, e, n, pk * BLOCK_K, kk, n < N, kk < K, swe, swn, swk,
                         sse, 0, 0, 0, 0, QKIND, GROUP, False, False, BLOCK_K, False)
        tl.store(out_ptr + e * N * K + n[None, :] * K + kk[:, None], wt, mask=(n[None, :] < N) & (kk[:, None] < K))

    return tile_kernel


@pytest.mark.parametrize("gguf_type", ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_K|Q5_K|Q6_K"])
def test_weight_tile_decodes_blocks_bit_exact(gguf_type):
    """Every element of a projection read through ``weight_tile`` equals the torch reference bit for bit (float32:
    every product is exact), for K tiles inside one block and spanning several (Q8_0)."""
    dq = load_kernels("ferrylm.experts.kernels.dequant")
    kernel = _tile_kernel()
    dev = kernel_device()
    fmt = mix_format(gguf_type.split("|")) if "|" in gguf_type else block_format(gguf_type)
    qt = random_quant(fmt, (2,), 16, 512, generator=torch.Generator().manual_seed(3), std=0.1,
                      dtype=torch.float32).to(dev)
    raw = qt._map(lambda t: torch.randint(0, 256, t.shape, dtype=torch.uint8,
                                          generator=torch.Generator().manual_seed(4)).to(dev))
    if raw.tag is not None:
        raw.tag.copy_(qt.tag)
    for q in (qt, raw):  # realistic blocks; arbitrary bytes (negative, subnormal, inf / NaN f16 scales)
        args, kw = dq.weight_args(q)
        want = q.dequantize(torch.float32).cpu().nan_to_num()
        for block_k in (16, 32, 64, 128):  # per-element below 32; whole Q8_0 blocks, K-quant sub-block pairs above
            out = torch.full((2, 16, 512), -1234.5, device=dev)
            kernel[(512 // block_k, 16 // 8, 2)](q.data, args[1], out, 16, 512, *args[4:8], QKIND=kw["QKIND"],
                                                 GROUP=kw["GROUP"], BLOCK_K=block_k, BLOCK_N=8)
            assert torch.equal(out.cpu().nan_to_num(), want), block_k
