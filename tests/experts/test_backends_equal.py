"""Every expert backend gives the resident backend's greedy tokens and logits (float32, within 1e-4) on tiny random
MoE models of each family and on the built-in MoE model, with a cache of ``top_k - 1`` slots (smaller than one
layer's needs: waves and eviction inside a step) and of ``top_k + 1`` slots, with prefill layer streaming on and
off, and with next-layer prefetch."""

from __future__ import annotations

import pytest
import torch
from tests.experts.helpers import greedy_trace, options
from tests.kernels.interp import load_kernels
from tests.models.hf_checkpoints import CASES, token_ids

from ferrylm.bench.decode import swap_executor
from ferrylm.experts import build_from_banks
from ferrylm.checkpoints.loader import load_model
from ferrylm.models.registry import MODEL_REGISTRY

TOL = 1e-4
NEW_TOKENS = 8
BACKENDS = ("offload", "cpu", "hybrid")
_FAMILY_ARCH = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                "qwen2_moe": "Qwen2MoeForCausalLM", "olmoe": "OlmoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                "minimax_m2": "MiniMaxM2ForCausalLM"}
# one case per MoE family whose model class exists (qwen3_moe: layer 0 dense, so MoE layers are 1 and 2; glm4_moe:
# layer 0 dense, sigmoid group-limited routing, shared expert; minimax_m2: sigmoid routing)
FAMILY_CASES = [c for c in ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "glm4_moe", "minimax_m2")
                if c in CASES and _FAMILY_ARCH[CASES[c][0]] in MODEL_REGISTRY]
_reference: dict[str, tuple[list[int], list[torch.Tensor]]] = {}


def _top_k(ckpt) -> int:
    import json

    return int(json.loads((ckpt.path / "config.json").read_text())["num_experts_per_tok"])


def _prompt(ckpt) -> list[int]:
    return token_ids(12, ckpt.vocab_size, seed=5).tolist()


def _resident(case: str, ckpt):
    if case not in _reference:
        _reference[case] = greedy_trace(load_model(ckpt.path).model, _prompt(ckpt), NEW_TOKENS)
    return _reference[case]


def _assert_same(ref, got, label: str) -> None:
    ref_tokens, ref_logits = ref
    tokens, logits = got
    assert tokens == ref_tokens, f"{label}: greedy tokens differ from resident"
    err = max((a - b).abs().max().item() for a, b in zip(logits, ref_logits))
    assert err <= TOL, f"{label}: logits differ from resident by {err:.2e}"


def _check_stats(ex) -> dict:
    s = ex.stats().as_dict()
    assert s["hits"] + s["misses"] == s["needed"] > 0
    assert sum(s["layer_hits"]) == s["hits"] and sum(s["layer_misses"]) == s["misses"]
    moved = s["fetched"] + s["prefetched"] + s["streamed"]
    assert s["bytes_copied"] == moved * s["expert_bytes"]
    assert s["prefetch_hits"] + s["prefetch_wasted"] <= s["prefetched"]
    assert s["steps"] == NEW_TOKENS + 2  # two prefill chunks + one step per generated token
    ex.cache.check()
    assert not ex.cache.pinned
    return s


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "nostream"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", FAMILY_CASES)
def test_backend_equals_resident(expert_checkpoints, case, backend, stream):
    ckpt = expert_checkpoints(case)
    ref = _resident(case, ckpt)
    k = _top_k(ckpt)
    for size in (max(1, k - 1), k + 1):
        # hybrid, small cache: no prefetch, so every step splits its misses by the bandwidths (the CPU takes half)
        split = backend == "hybrid" and size < k
        kw = {"prefetch": False} if split else {}
        loaded = load_model(ckpt.path, moe_backend=options(backend, size, stream_prefill=stream, **kw))
        ex = loaded.executor
        assert ex.name == backend and all(t.device.type == "cpu" for t in ex.banks.packed.values())
        got = greedy_trace(loaded.model, _prompt(ckpt), NEW_TOKENS)
        _assert_same(ref, got, f"{case}/{backend}/{size} slots/{'stream' if stream else 'no stream'}")
        s = _check_stats(ex)
        assert s["num_slots"] == size
        if backend == "offload":
            assert s["fetched"] > 0 and s["cpu_experts"] == 0
        elif backend == "cpu":
            assert s["fetched"] == 0 and s["prefetched"] == 0 and s["cpu_experts"] > 0
        elif split:
            assert s["fetched"] > 0 and s["cpu_experts"] > 0 and s["prefetched"] == 0
        else:  # prefetching: the tuner starts at share 0; misses are copied (the CPU takes only the overflow)
            assert s["fetched"] + s["prefetched"] > 0
            assert 1 in s["cpu_share"]  # the decode steps (1 token) are tuned
        assert (s["streamed"] > 0) == stream
        ex.close()


def test_builtin_moe_all_backends_equal_resident():
    """The built-in smollm2-moe (30 layers, 8 experts, top-2) loaded once; every backend shares its host banks."""
    from ferrylm.checkpoints.builtin import ensure_builtin

    loaded = load_model(ensure_builtin("smollm2-moe", progress=False), moe_backend=options("offload", 3))
    banks = loaded.executor.banks
    prompt = [1, 504, 3458, 282, 4649, 314]  # chunk of 4 (streamed: 4 x top-2 >= 8 experts), then 2 tokens
    ref = greedy_trace(swap_executor(loaded.model, build_from_banks("resident", banks, "cpu")), prompt, 2,
                       chunks=(4,))
    for backend, size in (("offload", 1), ("offload", 3), ("cpu", 3), ("hybrid", 3)):
        ex = build_from_banks(backend, banks, "cpu", options(backend, size))
        got = greedy_trace(swap_executor(loaded.model, ex), prompt, 2, chunks=(4,))
        _assert_same(ref, got, f"smollm2-moe/{backend}/{size} slots")
        ex.close()


@pytest.mark.parametrize("backend", ("resident",) + BACKENDS)
@pytest.mark.parametrize("case", FAMILY_CASES)
def test_batched_decode_path_equals_resident(expert_checkpoints, case, backend, monkeypatch):
    """The decode path the GPU runs (host-planned indices, one copy of them per layer, batched GEMMs over gathered
    expert weights, slots across several blocks) run on the CPU: same tokens and logits as the per-expert path."""
    from ferrylm.experts.work import LayerWork

    ckpt = expert_checkpoints(case)
    ref = _resident(case, ckpt)
    monkeypatch.setattr(LayerWork, "batch_on_cpu", True)
    k = _top_k(ckpt)
    if backend == "resident":
        loaded = load_model(ckpt.path)
    else:
        loaded = load_model(ckpt.path, moe_backend=options(backend, 2 * k + 1, stream_prefill=False))
        loaded.executor.block_slots = 2  # items of one layer land in several blocks
        loaded.executor.reserve(None)
    got = greedy_trace(loaded.model, _prompt(ckpt), NEW_TOKENS)
    _assert_same(ref, got, f"{case}/{backend}/batched")
    if loaded.executor is not None and backend != "resident":
        _check_stats(loaded.executor)
        loaded.executor.close()


@pytest.mark.parametrize("share", [1, 3])
@pytest.mark.parametrize("case", FAMILY_CASES)
def test_hybrid_planned_cpu_share_equals_resident(expert_checkpoints, case, share):
    """The hybrid's planned CPU share (``--moe-cpu-share``): ``share`` of each layer's predicted misses computed on
    the CPU at the next layer instead of prefetched (3: more than a layer has, so all of them)."""
    ckpt = expert_checkpoints(case)
    ref = _resident(case, ckpt)
    k = _top_k(ckpt)
    loaded = load_model(ckpt.path, moe_backend=options("hybrid", k + 1, stream_prefill=False, cpu_share=share))
    ex = loaded.executor
    got = greedy_trace(loaded.model, _prompt(ckpt), NEW_TOKENS)
    _assert_same(ref, got, f"{case}/hybrid with {share} planned CPU experts per layer")
    s = _check_stats(ex)
    assert s["cpu_share"] and all(v["share"] == share for v in s["cpu_share"].values())
    assert s["cpu_experts"] > 0
    if share == 3:
        assert s["prefetched"] == 0  # every predicted miss was planned for the CPU
    ex.close()


def test_hybrid_times_each_prefetching_step_once(expert_checkpoints, monkeypatch):
    """The tuner hooks: one ``step_done`` per step, with that step's share in use, keyed by the step's size."""
    from ferrylm.experts import hybrid

    made: dict[int, list] = {}

    class Spy:
        def __init__(self):
            self.share, self.settled, self.seconds = 0, None, []
            made.setdefault(len(made), self.seconds)

        def step_done(self, seconds: float) -> None:
            assert seconds > 0
            self.seconds.append(seconds)
            self.share = 1 - self.share  # alternate 0 / 1: both policies run within the trace

    monkeypatch.setattr(hybrid, "ShareTuner", Spy)
    ckpt = expert_checkpoints("qwen3_moe")
    ref = _resident("qwen3_moe", ckpt)
    loaded = load_model(ckpt.path, moe_backend=options("hybrid", _top_k(ckpt) + 1, stream_prefill=False))
    got = greedy_trace(loaded.model, _prompt(ckpt), NEW_TOKENS)
    _assert_same(ref, got, "qwen3_moe/hybrid with alternating shares")
    s = loaded.executor.stats().as_dict()
    assert sorted(s["cpu_share"]) == [1, 5, 7]  # the two prefill chunks (7 + 5 tokens) and the decode steps
    assert sorted(len(v) for v in made.values()) == [1, 1, NEW_TOKENS]
    loaded.executor.close()


def test_streamed_fused_layer_reads_hits_from_their_slots(expert_checkpoints, monkeypatch):
    """The CUDA form of a streamed layer (one fused MoE call reading cache hits from their slot rows and the rest
    from the layer buffer through row offsets; Triton's interpreter here): a second prompt prefilled after a decode
    filled the cache meets hits inside streamed layers and still gives resident's tokens and logits."""
    load_kernels("ferrylm.experts.kernels.fused_moe")
    import ferrylm.experts.stream as stream

    hits_seen = []
    run = stream.StreamedPrefill._run_streamed_fused

    def spy(self, work, hits, idx, rest):
        hits_seen.append(len(hits))
        return run(self, work, hits, idx, rest)

    monkeypatch.setattr(stream, "use_triton", lambda x: True)
    monkeypatch.setattr(stream.StreamedPrefill, "_run_streamed_fused", spy)
    ckpt = expert_checkpoints("qwen3_moe")
    k = _top_k(ckpt)
    loaded = load_model(ckpt.path, moe_backend=options("offload", 2 * k, stream_prefill=True, prefetch=False))
    second = token_ids(12, ckpt.vocab_size, seed=9).tolist()
    greedy_trace(loaded.model, _prompt(ckpt), 3)
    before = len(hits_seen)
    got = greedy_trace(loaded.model, second, 3)
    ref = greedy_trace(load_model(ckpt.path).model, second, 3)
    assert before > 0 and any(n > 0 for n in hits_seen[before:])
    _assert_same(ref, got, "offload/stream/fused")
    loaded.executor.close()
