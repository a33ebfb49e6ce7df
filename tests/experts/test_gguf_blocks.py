"""GGML block formats kept as bytes (``experts/gguf_blocks.py`` + the block kinds of ``QuantFormat``): the torch
reference equals gguf-py's ``gguf.quants.dequantize`` bit for bit, sizes are the file's bits per weight, an expert row
holds the blocks' bytes unchanged, and every backend computes block experts as dequantize-then-GEMM."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.experts.helpers import assert_backend_close, options

from ferrylm.experts import build_executor
from ferrylm.experts.banks import HostBanks
from ferrylm.experts.executor import ExpertLayout
from ferrylm.experts.executor import LayerExperts
from ferrylm.experts.gguf_blocks import BLOCK_TYPES, dequantize_blocks
from ferrylm.experts.quantized import ExpertQuant, QuantFormat, QuantTensor, block_format, random_quant
from ferrylm.experts.resident import run_grouped

gguf = pytest.importorskip("gguf")
TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q8_0"]
BPW = {"Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625, "Q8_0": 8.5}


def _oracle(data: torch.Tensor, name: str) -> torch.Tensor:
    out = gguf.quants.dequantize(data.numpy(), getattr(gguf.GGMLQuantizationType, name))
    return torch.from_numpy(np.array(out, copy=True))


@pytest.mark.parametrize("name", TYPES)
def test_reference_equals_gguf_py_bit_for_bit(name):
    """Arbitrary bytes (every scale/min/code pattern; f16 scales may be inf/NaN) and realistic random blocks."""
    bt = BLOCK_TYPES[name.lower()]
    g = torch.Generator().manual_seed(7)
    raw = torch.randint(0, 256, (3, 5, 512 // bt.elems * bt.nbytes), generator=g, dtype=torch.uint8)
    with np.errstate(all="ignore"):
        assert torch.equal(dequantize_blocks(raw, bt.name.lower()).nan_to_num(), _oracle(raw, name).nan_to_num())
    qt = random_quant(block_format(name), (3,), 5, 512, generator=g, std=0.05, dtype=torch.float32)
    ref = _oracle(qt.data, name)
    assert torch.equal(qt.dequantize(), ref) and ref.isfinite().all() and 0.01 < ref.std() < 0.2
    assert qt.shape == (3, 5, 512) and qt.scales is None and qt.nbytes == raw.numel()


@pytest.mark.parametrize("name", TYPES)
def test_formats_count_the_files_bits(name):
    fmt = block_format(name)
    assert fmt.bits_per_weight(768, 2048) == BPW[name] and fmt.describe() == f"{name} (ggml blocks)"
    assert fmt.fields(768, 2048) == [("data", torch.uint8, (768, 2048 // fmt.group * BLOCK_TYPES[fmt.kind].nbytes))]
    with pytest.raises(ValueError, match="multiple of"):
        fmt.check_shape(4, fmt.group * 3 // 2 if fmt.group > 32 else 48)
    with pytest.raises(ValueError, match="block size"):
        QuantFormat(fmt.kind, 16)
    with pytest.raises(ValueError, match="without scales"):
        QuantTensor(fmt, torch.zeros(2, 4, 7, dtype=torch.uint8))


E, H, I = 4, 256, 256
MIXED = ExpertQuant(block_format("Q4_K"), block_format("Q6_K"))  # Q4_K_M's gate/up and down


def _layers(quant: ExpertQuant, seed: int = 0) -> dict[int, LayerExperts]:
    g = torch.Generator().manual_seed(seed)
    rq = lambda f, n, k: random_quant(f, (E,), n, k, generator=g, std=k ** -0.5, dtype=torch.float32)  # noqa
    return {n: LayerExperts(gate=rq(quant.gate_up, I, H), up=rq(quant.gate_up, I, H), down=rq(quant.down, H, I))
            for n in range(2)}


def test_rows_hold_the_blocks_bytes():
    """An expert's row is its gate blocks, up blocks and down blocks, byte for byte, at 64-byte aligned offsets."""
    layers = _layers(MIXED)
    layout = ExpertLayout.of(layers[0])
    gate, dn = I * H // 256 * 144, H * I // 256 * 210  # bytes of one expert's gate (= up) and down
    off = -(-2 * gate // 64) * 64
    assert layout.nbytes == -(-(off + dn) // 64) * 64
    banks = HostBanks.from_layers(layers, pin=False)
    for n, le in layers.items():
        for e in range(E):
            row = banks.row(n, e)
            assert torch.equal(row[:gate], le.gate.data[e].reshape(-1))
            assert torch.equal(row[gate:2 * gate], le.up.data[e].reshape(-1))
            assert torch.equal(row[off:off + dn], le.down.data[e].reshape(-1))
            g, u, d = layout.views(row)
            assert torch.equal(d.dequantize(torch.float32), le.down[e].dequantize(torch.float32))


def test_every_backend_computes_block_experts():
    """resident / offload / cpu / hybrid (a cache smaller than a step's needs) against dequantize-then-GEMM (the
    CPU's within the 8-bit activations' tolerance)."""
    want = {n: LayerExperts(le.gate.dequantize(), le.up.dequantize(), le.down.dequantize())
            for n, le in _layers(MIXED).items()}
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(6)])
    w = torch.rand(6, 2, generator=g)
    for backend in ("resident", "offload", "cpu", "hybrid"):
        ex = build_executor(options(backend, 2), _layers(MIXED), "cpu")
        try:
            for t in (6, 1):
                got = ex.run(1, x[:t], ids[:t], w[:t])
                assert_backend_close(backend, got, run_grouped(want[1], x[:t], ids[:t], w[:t]), t)
        finally:
            ex.close()


@pytest.mark.parametrize("quant", ["q4_k", "q4_k_m", "q8_0"])
def test_synthetic_block_quant_builds_and_backends_agree(quant):
    """``synthetic:...:quant=q4_k`` etc.: random whole blocks at the file's bits per weight, the init scale kept, the
    same greedy tokens on every backend."""
    from tests.experts.helpers import greedy_trace
    from tests.models.test_synthetic import tiny

    from ferrylm.synthetic.spec import SyntheticSpec
    from ferrylm.checkpoints.synthetic_build import build_synthetic

    preset = tiny("qwen3-30b-a3b", moe_intermediate_size=256, hidden_size=256, head_dim=32)
    spec = SyntheticSpec(preset, 2, quant=quant)
    ref = build_synthetic(spec, dtype=torch.float32)
    le = ref.executor.layers[0]
    bpw = {"q4_k": (4.5, 4.5), "q4_k_m": (4.5, 6.5625), "q8_0": (8.5, 8.5)}[quant]
    assert le.expert_bytes * 8 == (2 * bpw[0] + bpw[1]) * 256 * 256
    assert 0.5 < le.gate.dequantize(torch.float32).std().item() * 256 ** 0.5 < 2.0
    assert le.down.dequantize(torch.float32).isfinite().all()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = greedy_trace(ref.model, prompt, 3)[0]
    for backend in ("offload", "cpu", "hybrid"):
        got = greedy_trace(build_synthetic(spec, dtype=torch.float32, moe_backend=options(backend, 2)).model, prompt, 3)
        assert got[0] == want, backend


def test_kmix_tags_each_expert_with_its_kind():
    """``kmix``: rows padded to the widest kind, one tag byte per expert; each expert decodes as its kind (gguf-py's
    dequantize on the leading bytes of its rows); a tag outside the mix is refused; the tag survives row views."""
    from ferrylm.experts.quantized import mix_format

    fmt = mix_format(["Q6_K", "Q4_K"])
    assert fmt.mix == ("q4_k", "q6_k") and fmt.packed_k(512) == 420
    with pytest.raises(ValueError, match="K-quant kinds"):
        QuantFormat("kmix", 256, mix=("q6_k", "q4_k"))
    with pytest.raises(ValueError, match="K-quant kinds"):
        mix_format(["Q8_0", "Q4_K"])
    qt = random_quant(fmt, (4,), 6, 512, generator=torch.Generator().manual_seed(2), std=0.1, dtype=torch.float32)
    assert qt.tag.reshape(-1).tolist() == [6, 8, 6, 8]
    w = qt.dequantize()
    for e, name in enumerate(["Q4_K", "Q6_K"] * 2):
        rb = 2 * BLOCK_TYPES[name.lower()].nbytes
        assert torch.equal(w[e], _oracle(qt.data[e, :, :rb].contiguous(), name))
        assert torch.equal(qt.rows(2, 5)[e].dequantize(), w[e, 2:5])
    qt.tag[1] = 5
    with pytest.raises(ValueError, match="not one of the mix"):
        qt.dequantize()
