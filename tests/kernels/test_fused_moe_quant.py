"""The fused MoE kernels on quantized experts (int4, int4 with mins, int8, fp4 MXFP4-like and NVFP4-like with a row
scale, fp8) against dequantize-then-matmul (``experts.resident.run_grouped`` over the QuantTensor stacks, which
dequantizes to the activation dtype): resident stacks and quantized slot-cache byte rows through ``slot_of``, decode
and prefill tiles, group sizes smaller and larger than the K tile. CPU: Triton's interpreter in float32 (small
shapes, CI); GPU: bfloat16 (tests/gpu runs the same file)."""

from __future__ import annotations

import pytest
import torch

from ferrylm.experts.banks import ExpertLayout
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
