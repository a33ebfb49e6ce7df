"""The fused MoE kernels on quantized experts (int4, int4 with mins, int8, fp4 MXFP4-like and NVFP4-like with a row
scale, fp8) against dequantize-then-matmul (``experts.resident.run_grouped`` over the QuantTensor stacks, which
dequantizes to the activation dtype): resident stacks and quantized slot-cache byte rows through ``slot_of``, decode
and prefill tiles, group sizes smaller and larger than the K tile. CPU: Triton's interpreter in float32 (small
shapes, CI); GPU: bfloat16 (tests/gpu runs the same file)."""

from __future__ import annotations

import pytest
import torch

from ferrylm.experts.executor import ExpertLayout
from ferrylm.experts.executor import LayerExperts
from ferrylm.experts.quantized import ExpertQuant, QuantFormat, random_quant
from ferrylm.experts.resident import run_grouped
from tests.kernels.interp import kernel_device, load_kernels

FORMATS = {
    "int4": ExpertQuant(QuantFormat("int4", 32), QuantFormat("int4", 16)),
    "int4-mins/int8": ExpertQuant(QuantFormat("int4", 16, torch.float32, mins=True),
                                  QuantFormat("int8", 32, torch.float16)),
    "mxfp4": ExpertQuant(QuantFormat("fp4", 32, torch.bfloat16), QuantFormat("fp4", 16, torch.bfloat16)),
    "nvfp4": ExpertQuant(QuantFormat("fp4", 16, torch.float8_e4m3fn, row_scale=True),
                         QuantFormat("fp4", 16, torch.float8_e4m3fn, row_scale=True)),
    "fp8": ExpertQuant(QuantFormat("fp8", 128, torch.float32), QuantFormat("fp8", 32, torch.float32)),
    # groups holding whole K tiles: the scale multiplies the dot's result (dequant.scale_after_dot)
    "int4-g128/int8-g64": ExpertQuant(QuantFormat("int4", 128), QuantFormat("int8", 64, torch.bfloat16)),
}


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("t,slots", [(3, False), (2, True), (40, True)], ids=["decode", "decode-slots", "prefill-slots"])
def test_quantized_fused_moe_matches_dequantize_then_matmul(name, t, slots):
    m = load_kernels("ferrylm.experts.kernels.fused_moe")
    dev = kernel_device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    e, k, h, i = 8, 2, 128, 64
    q = FORMATS[name]
    gen = torch.Generator().manual_seed(t + len(name))
    le = LayerExperts(gate=random_quant(q.gate_up, (e,), i, h, generator=gen, std=h ** -0.5, dtype=dtype),
                      up=random_quant(q.gate_up, (e,), i, h, generator=gen, std=h ** -0.5, dtype=dtype),
                      down=random_quant(q.down, (e,), h, i, generator=gen, std=i ** -0.5, dtype=dtype))
    x = torch.randn(t, h, generator=gen).to(dtype)
    w, ids = torch.topk(torch.randn(t, e, generator=gen).softmax(-1), k)
    ref = run_grouped(le, x, ids, w).double()  # dequantize (to the activation dtype), then the GEMM chains
    x, ids, w = x.to(dev), ids.to(dev), w.to(dev)
    if slots:  # quantized byte rows scattered over a larger slot buffer, found through slot_of
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


def test_scale_after_dot_only_where_a_group_holds_whole_tiles():
    dq = load_kernels("ferrylm.experts.kernels.dequant")
    gen = torch.Generator().manual_seed(0)
    fp8 = dq.weight_args(random_quant(QuantFormat("fp8", 128), (2,), 8, 256, generator=gen, dtype=torch.float32))[1]
    assert dq.scale_after_dot(fp8, 128) and dq.scale_after_dot(fp8, 64) and not dq.scale_after_dot(fp8, 256)
    mins = dq.weight_args(random_quant(QuantFormat("int4", 128, torch.float32, mins=True), (2,), 8, 256,
                                       generator=gen, dtype=torch.float32))[1]
    assert not dq.scale_after_dot(mins, 128)  # u * s - m: the min is per element of the tile
    q4k = dq.weight_args(random_quant(QuantFormat("q4_k", 256), (2,), 8, 256, generator=gen, dtype=torch.float32))[1]
    assert not dq.scale_after_dot(q4k, 128)  # GGML blocks: sub-block scales inside the tile


def _values_kernel():
    """A kernel writing ``weight_values`` of a ``[1, N, K]`` fp8 projection as float32 (module globals, as in
    test_fused_moe_gguf)."""
    import triton
    import triton.language as tl

    from ferrylm.experts.kernels.dequant import weight_values

    globals().update(tl=tl, weight_values=weight_values)

    @triton.jit
    def values_kernel(w_ptr, out_ptr, N, K, HW_FP8: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        kk = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        v = weight_values(w_ptr, 0, n, tl.program_id(0) * BLOCK_K, kk, n < N, kk < K, 0, K, 1, 4, False, BLOCK_K,
                          HW_FP8)
        tl.store(out_ptr + n[None, :] * K + kk[:, None], v.to(tl.float32), mask=(n[None, :] < N) & (kk[:, None] < K))

    return values_kernel


def test_fp8_values_equal_torch_conversion_for_every_code():
    """Every e4m3 code but the two NaNs, decoded by the kernel (in hardware on sm89+, from the bits elsewhere),
    equals torch's float8_e4m3fn -> float32 conversion bit for bit (subnormals and -0 included)."""
    dq = load_kernels("ferrylm.experts.kernels.dequant")
    kernel = _values_kernel()
    dev = kernel_device()
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8).reshape(2, 127)
    want = codes.view(torch.float8_e4m3fn).float()
    out = torch.full((2, 127), -1234.5, device=dev)
    for hw in sorted({False, dq.hardware_fp8(dev)}):
        out.fill_(-1234.5)
        kernel[(1, 1)](codes.to(dev), out, 2, 127, HW_FP8=hw, BLOCK_K=128, BLOCK_N=2)  # K tile with a masked tail
        assert torch.equal(out.cpu(), want), hw
        assert torch.equal(torch.signbit(out.cpu()), torch.signbit(want)), hw  # -0 too
