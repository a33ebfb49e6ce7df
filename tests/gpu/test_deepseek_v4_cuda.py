"""DeepSeek-V4 on a GPU: the synthetic ``deepseek-v4-flash`` preset at test size (``tests/models/test_synthetic.tiny``;
layers sliding, CSA, HCA, CSA) greedy through the engine. Skipped without CUDA; written without a GPU at hand (the
kernels are checked against the torch reference in Triton's interpreter: tests/kernels/test_compressed_attention.py,
which on a GPU also runs them in bfloat16).

* float32, eager steps: the Triton backend (``TritonPagedAttention.attend_compressed``: window rows, pooled entries,
  the indexer's top-k and the sinks in the kernels of ``engine/attention/triton_compress.py`` /
  ``triton_compressed.py``) gives the torch backend's greedy tokens exactly and its logprobs within 1e-4, over
  prompts prefilled in 24-token chunks across 16-token pages and compression blocks, decodes beside prefills;
* the whole-step decode CUDA graphs capture those kernels (no host sync inside) and replay the eager tokens;
* the offloading expert backends boot with default flags and decode to the same tokens: offload's batches in
  whole-step graphs, the steps those do not take eager (DeepSeek-V4 has no piecewise graphs: ``capabilities.piecewise_graphs``).
"""

from __future__ import annotations

import pytest
import torch
from tests.gpu.test_decode_graph_cuda import _generate  # greedy tokens + logprobs per request
from tests.models.test_synthetic import tiny

from ferrylm.config import EngineConfig
from ferrylm.engine.boot import build_engine
from ferrylm.synthetic import spec as synthetic

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NEW = 12
LAYERS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
          "compressed_sparse_attention"]


@pytest.fixture
def tiny_v4(tmp_path, monkeypatch):
    """The test-size preset (4 heads of 16 dims, window 4, CSA rate 4 with top-2, HCA rate 8), materialized."""
    preset = tiny("deepseek-v4-flash", num_hidden_layers=4, layer_types=LAYERS)
    monkeypatch.setitem(synthetic.PRESETS, "tiny-dsv4", synthetic.SyntheticPreset("tiny-dsv4", "test", preset.config))
    return synthetic.materialize(synthetic.parse_synthetic_spec("synthetic:tiny-dsv4:layers=4"), tmp_path / "syn")


def _prompts() -> dict[str, list[int]]:
    """61 tokens (15 CSA entries: the top-2 choose), 30, and a 5-token prompt (decodes before any entry closes)."""
    return {"a": [(7 * i + 3) % 96 for i in range(61)], "b": [(5 * i + 1) % 96 for i in range(30)],
            "c": [11, 4, 90, 23, 7]}


def _config(**kw) -> EngineConfig:
    base = dict(device="cuda", dtype="float32", num_pages=64, page_size=16, max_prefill_length=24,
                max_running_requests=3, moe_backend="resident", check_invariants=True)
    return EngineConfig(**{**base, **kw})


def test_triton_backend_equals_torch_backend(tiny_v4):
    runs = {name: _generate(build_engine(tiny_v4, _config(attention_backend=name, decode_graphs="off")), _prompts(),
                            NEW) for name in ("torch", "triton")}
    assert runs["triton"][0] == runs["torch"][0]
    for rid in _prompts():
        assert len(runs["triton"][0][rid]) == NEW
        assert runs["triton"][1][rid] == pytest.approx(runs["torch"][1][rid], abs=1e-4), rid


def test_decode_graphs_replay_the_eager_tokens(tiny_v4):
    results = {}
    for mode in ("off", "cuda"):
        engine = build_engine(tiny_v4, _config(attention_backend="triton", decode_graphs=mode))
        results[mode] = _generate(engine, _prompts(), NEW)
        if mode == "cuda":
            st = engine.stats()["decode_graphs"]
            assert st["kind"] == "step" and st["mode"] == "cuda" and st["replays"] >= 5, st
    assert results["cuda"][0] == results["off"][0]
    for rid in _prompts():
        assert results["cuda"][1][rid] == pytest.approx(results["off"][1][rid], abs=1e-4), rid


@pytest.mark.parametrize("backend", ["offload", "hybrid"])
def test_offloading_experts_with_default_graph_flags(tiny_v4, backend):
    """Offload: batches of 2+ in whole-step graphs (the device expert table), one-token steps eager (no piecewise
    graphs); hybrid (not graph-safe): every step eager. Both give the resident backend's tokens."""
    want = _generate(build_engine(tiny_v4, _config(decode_graphs="off")), _prompts(), NEW)[0]
    engine = build_engine(tiny_v4, _config(moe_backend=backend, moe_cache_size=3))
    assert _generate(engine, _prompts(), NEW)[0] == want
    st = engine.stats().get("decode_graphs")
    if backend == "offload":
        assert st["kind"] == "step" and st["replays"] >= 1 and "piecewise" not in st, st
    else:
        assert st is None
