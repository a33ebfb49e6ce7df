"""Quantized expert representations: the reference dequantization formulas, byte rows in banks and slots (so copies
move quantized bytes), every backend agreeing on quantized experts (per-expert, batched and staged GEMM paths), the
memory plan's sizes, and ``synthetic:<preset>:quant=Q``."""

from __future__ import annotations

import pytest
import torch
from tests.experts.helpers import assert_backend_close, options
from tests.models.test_synthetic import tiny

from ferrylm.errors import ModelLoadError
from ferrylm.experts import build_executor
from ferrylm.experts.banks import HostBanks
from ferrylm.experts.executor import ExpertLayout
from ferrylm.experts.executor import LayerExperts
from ferrylm.experts.quantized import E2M1_VALUES, ExpertQuant, QuantFormat, QuantTensor, random_quant
from ferrylm.experts.resident import run_grouped
from ferrylm.experts.work import ExpertStage, LayerWork, staged_moe_output
from ferrylm.synthetic.spec import SyntheticSpec, parse_synthetic_spec
from ferrylm.checkpoints.synthetic_build import build_synthetic

FORMATS = {
    "int4": ExpertQuant(QuantFormat("int4", 16), QuantFormat("int4", 16)),
    "int4-mins": ExpertQuant(QuantFormat("int4", 16, torch.float32, mins=True), QuantFormat("int8", 8, torch.float16)),
    "fp8": ExpertQuant(QuantFormat("fp8", 16, torch.float32), QuantFormat("fp8", 8, torch.float32)),
    "mxfp4": ExpertQuant(QuantFormat("fp4", 16, torch.bfloat16), QuantFormat("fp4", 16, torch.bfloat16)),
    "nvfp4": ExpertQuant(QuantFormat("fp4", 16, torch.float8_e4m3fn, row_scale=True),
                         QuantFormat("fp4", 16, torch.float8_e4m3fn, row_scale=True)),
}
E, H, I = 6, 64, 32


def test_reference_formulas():
    fmt = QuantFormat("int4", 4)
    qt = QuantTensor(fmt, torch.tensor([[0x10, 0xF8]], dtype=torch.uint8), torch.tensor([[0.5]]).bfloat16(),
                     dtype=torch.float32)
    assert qt.dequantize().tolist() == [[-4.0, -3.5, 0.0, 3.5]]  # codes 0, 1, 8, 15 -> (u - 8) * 0.5
    mins = QuantTensor(QuantFormat("int4", 2, torch.float32, mins=True), torch.tensor([[0x21, 0x03]], dtype=torch.uint8),
                       torch.tensor([[2.0, 3.0]]), torch.tensor([[1.0, 0.5]]), dtype=torch.float32)
    assert mins.dequantize().tolist() == [[1.0, 3.0, 8.5, -0.5]]  # u * s - m
    codes = torch.arange(16, dtype=torch.uint8)
    fp4 = QuantTensor(QuantFormat("fp4", 32, torch.float8_e4m3fn, row_scale=True),
                      (codes[0::2] | (codes[1::2] << 4))[None].repeat(1, 2), torch.tensor([[2.0]]).to(torch.float8_e4m3fn),
                      row_scale=torch.tensor([0.25]), dtype=torch.float32)
    assert fp4.dequantize()[0, :16].tolist() == [0.5 * v for v in E2M1_VALUES]  # e2m1 * (2 * 0.25)
    fp8 = QuantTensor(QuantFormat("fp8", 2, torch.float32), torch.tensor([[1.5, -448.0]]).to(torch.float8_e4m3fn),
                      torch.tensor([[0.5]]), dtype=torch.float32)
    assert fp8.dequantize().tolist() == [[0.75, -224.0]]
    with pytest.raises(ValueError, match="do not fit"):
        QuantTensor(fmt, torch.zeros(2, 4, dtype=torch.uint8), torch.zeros(2, 3).bfloat16())


def _layers(quant: ExpertQuant, seed: int = 0, n_layers: int = 2) -> dict[int, LayerExperts]:
    g = torch.Generator().manual_seed(seed)
    rq = lambda f, n, k: random_quant(f, (E,), n, k, generator=g, std=k ** -0.5, dtype=torch.float32)  # noqa
    return {layer: LayerExperts(gate=rq(quant.gate_up, I, H), up=rq(quant.gate_up, I, H), down=rq(quant.down, H, I))
            for layer in range(n_layers)}


def _dense(layers):
    return {n: LayerExperts(le.gate.dequantize(), le.up.dequantize(), le.down.dequantize()) for n, le in layers.items()}


@pytest.mark.parametrize("name", list(FORMATS))
def test_rows_hold_the_quantized_bytes(name):
    quant = FORMATS[name]
    layers = _layers(quant)
    want = _dense(layers)
    layout = ExpertLayout.of(layers[0])
    fields = quant.gate_up.expert_bytes(2 * I, H) + quant.down.expert_bytes(H, I)
    assert layout.row_dtype == torch.uint8 and fields <= layout.nbytes < fields + 64 * 8
    assert layout.nbytes % 64 == 0 and layers[0].expert_bytes == fields
    banks = HostBanks.from_layers(layers, pin=False)
    assert all(t.dtype == torch.uint8 and t.shape == (E, layout.nbytes) for t in banks.packed.values())
    for n in banks.layers:  # the views over the rows dequantize to what was packed
        le = banks.layer_experts(n)
        assert torch.equal(le.gate.dequantize(), want[n].gate) and torch.equal(le.down.dequantize(), want[n].down)
        g, u, d = layout.views(banks.row(n, 3))
        assert torch.equal(u.dequantize(), want[n].up[3])


@pytest.mark.parametrize("name", list(FORMATS))
def test_every_backend_computes_quantized_experts(name):
    """resident / offload / cpu / hybrid (cache smaller than a step's needs) against dequantize-then-GEMM, for a
    prefill-sized step and a decode step, per expert and batched (the GPU's path, run on the CPU); the CPU's within
    the 8-bit activations' tolerance."""
    quant = FORMATS[name]
    want_layers = _dense(_layers(quant))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(10)])
    w = torch.rand(10, 2, generator=g)
    for batched in (False, True):
        LayerWork.batch_on_cpu = batched
        try:
            for backend in ("resident", "offload", "cpu", "hybrid"):
                ex = build_executor(options(backend, 3), _layers(quant), "cpu")
                for t in (10, 3, 1):
                    want = run_grouped(want_layers[1], x[:t], ids[:t], w[:t])
                    got = ex.run(1, x[:t], ids[:t], w[:t])
                    assert_backend_close(backend, got, want, (t, batched))
                if backend != "resident":
                    s = ex.stats().as_dict()
                    assert s["expert_bytes"] == ExpertLayout.of(_layers(quant)[0]).nbytes
                    assert s["bytes_copied"] == (s["fetched"] + s["prefetched"] + s["streamed"]) * s["expert_bytes"]
                    assert ex.slot_needs().slot_bytes == s["expert_bytes"]
                ex.close()
        finally:
            LayerWork.batch_on_cpu = False


def test_staged_step_reads_quantized_rows():
    """The decode graph's staged computation over quantized byte rows equals the executor's own result."""
    quant = FORMATS["int4-mins"]
    layers = _layers(quant, n_layers=1)
    layout = ExpertLayout.of(layers[0])
    banks = HostBanks.from_layers(layers, pin=False)
    ref = banks.layer_experts(0)
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(2, H, generator=g), torch.rand(2, 2, generator=g)
    ids = torch.tensor([[1, 4], [4, 0]])
    stage = ExpertStage.create(torch.zeros(4, layout.numel, dtype=layout.row_dtype), layout, 2, 2, H, torch.float32)
    work = LayerWork.from_host_ids(0, x, ids, w, ids.tolist(), E)
    work.stage = stage
    experts = work.needed
    assert work.can_stage(experts)
    torch.stack([banks.row(0, e) for e in experts], out=stage.rows[:len(experts)])
    work.stage_into(experts)
    stage.set_staged()
    assert (staged_moe_output(stage, x, w) - run_grouped(ref, x, ids, w)).abs().max().item() <= 1e-5


def test_synthetic_quant_spec():
    spec = parse_synthetic_spec("synthetic:qwen3-30b-a3b:layers=2:quant=int4")
    assert spec.quant == "int4" and spec.name == "synthetic:qwen3-30b-a3b:layers=2:quant=int4"
    with pytest.raises(ModelLoadError, match=r"unknown quant 'int3'; quant formats: fp8, int4, mxfp4, nvfp4"):
        parse_synthetic_spec("synthetic:qwen3-30b-a3b:quant=int3")


@pytest.mark.parametrize("quant", ["fp8", "int4", "mxfp4", "nvfp4"])
def test_synthetic_quant_builds_and_backends_agree(quant):
    """Random codes of the format (a quarter to a half of the bf16 bytes), sane logits, the same greedy tokens on
    every backend."""
    from tests.experts.helpers import greedy_trace

    preset = tiny("qwen3-30b-a3b", moe_intermediate_size=128, hidden_size=128, head_dim=32)  # fp8: groups of 128
    spec = SyntheticSpec(preset, 3, quant=quant)
    ref = build_synthetic(spec, dtype=torch.float32)
    le = ref.executor.layers[0]
    assert isinstance(le.gate, QuantTensor)
    bf16_bytes = 3 * 128 * 128 * 2
    assert le.expert_bytes < (0.6 if quant == "fp8" else 0.35) * bf16_bytes
    assert 0.5 < le.gate.dequantize(torch.float32).std().item() * 128 ** 0.5 < 2.0  # init scale kept
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = greedy_trace(ref.model, prompt, 4)[0]
    for backend in ("offload", "cpu", "hybrid"):
        got = greedy_trace(build_synthetic(spec, dtype=torch.float32, moe_backend=options(backend, 2)).model, prompt, 4)
        assert got[0] == want, backend


def test_ferry_models_lists_the_formats():
    from ferrylm.checkpoints.catalog import describe_models

    text = describe_models()
    assert "quant=int4" in text and "quant=nvfp4" in text
    assert "compressed-tensors pack-quantized" in text and "GGUF experts Q8_0 / Q6_K / Q4_K" in text
