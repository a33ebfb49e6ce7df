"""The quantized fused MoE kernels on the GPU at real shapes (Qwen3-30B-A3B experts: H 2048, I 768, 128 experts,
top-8) against dequantize-then-bf16-matmul, for every internal format, resident stacks and slot rows, batch 1 / 16 /
64 / 512; and the synthetic quantized models through the resident and offload backends on CUDA against the CPU
reference. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from ferrylm.experts.executor import ExpertLayout
from ferrylm.experts.executor import LayerExperts
from ferrylm.experts.quantized import QuantFormat, random_quant
from ferrylm.experts.resident import run_grouped

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FORMATS = {
    "int4": QuantFormat("int4", 128, torch.bfloat16),
    "int4-mins": QuantFormat("int4", 32, torch.float32, mins=True),
    "int8": QuantFormat("int8", 32, torch.float16),
    "mxfp4": QuantFormat("fp4", 32, torch.bfloat16),
    "nvfp4": QuantFormat("fp4", 16, torch.float8_e4m3fn, row_scale=True),
    "fp8": QuantFormat("fp8", 128, torch.float32),
}


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("t", [1, 16, 64, 512])
def test_quantized_fused_moe_real_shapes(name, t):
    from ferrylm.experts.kernels.fused_moe import fused_moe

    fmt = FORMATS[name]
    e, k, h, i = 128, 8, 2048, 768
    gen = torch.Generator().manual_seed(t)
    le = LayerExperts(gate=random_quant(fmt, (e,), i, h, generator=gen, std=h ** -0.5),
                      up=random_quant(fmt, (e,), i, h, generator=gen, std=h ** -0.5),
                      down=random_quant(fmt, (e,), h, i, generator=gen, std=i ** -0.5)).to("cuda")
    x = torch.randn(t, h, generator=gen).to("cuda", torch.bfloat16)
    w, ids = torch.topk(torch.randn(t, e, generator=gen).softmax(-1), k)
    ids, w = ids.cuda(), w.cuda()
    dense = LayerExperts(le.gate.dequantize(torch.bfloat16), le.up.dequantize(torch.bfloat16),
                         le.down.dequantize(torch.bfloat16))
    ref = run_grouped(dense, x, ids, w).double()
    out = fused_moe(x, le.gate, le.up, le.down, ids, w)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-2
    lay = ExpertLayout.of(le)
    rows = torch.zeros(e + 7, lay.numel, dtype=torch.uint8, device="cuda")
    where = torch.randperm(e + 7, generator=gen)[:e].cuda()
    packed = torch.zeros(e, lay.numel, dtype=torch.uint8, device="cuda")
    lay.pack(packed, le)
    rows[where] = packed
    v = lay.layer_views(rows)
    out = fused_moe(x, v.gate, v.up, v.down, ids, w, slot_of=where.to(torch.int32))
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-2


@pytest.mark.parametrize("quant", ["int4", "fp8", "mxfp4", "nvfp4"])
def test_synthetic_quant_on_cuda_matches_cpu(quant):
    from tests.experts.helpers import options
    from tests.models.test_synthetic import tiny

    from ferrylm.models.reference_attention import DenseCausalAttention
    from ferrylm.synthetic.spec import SyntheticSpec
    from ferrylm.checkpoints.synthetic_build import build_synthetic

    spec = SyntheticSpec(tiny("qwen3-30b-a3b", moe_intermediate_size=128, hidden_size=256, head_dim=64), 3,
                         quant=quant)
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    cpu = build_synthetic(spec, dtype=torch.float32)
    with torch.no_grad():
        want = cpu.model.compute_logits(cpu.model(ids, torch.arange(8), DenseCausalAttention()))
    for backend in ("resident", "offload"):
        m = build_synthetic(spec, dtype=torch.float32, device="cuda", moe_backend=options(backend, 4))
        with torch.no_grad():
            got = m.model.compute_logits(m.model(ids.cuda(), torch.arange(8, device="cuda"), DenseCausalAttention()))
        assert (got.cpu() - want).abs().max().item() < 1e-2, backend
