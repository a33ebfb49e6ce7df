"""The offload backend's table path (experts/slot_table.py): decode steps from a device table of expert row offsets,
misses read from the host banks by the fused kernel itself, installs planned between steps. On the CPU the kernel
runs in Triton's interpreter (``table_on_cpu``); greedy tokens and logits equal the resident backend's, the cache
bookkeeping stays consistent, and the table always points every expert at the row that holds it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.experts.helpers import options
from tests.kernels.interp import load_kernels
from tests.models.hf_checkpoints import CASES, token_ids

from ferrylm.experts.offload import OffloadExecutor
from ferrylm.models.reference_attention import SequenceCacheAttention
from ferrylm.checkpoints.loader import load_model

NEW_TOKENS = 10
TOL = 1e-4


@pytest.fixture
def table_on_cpu(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the CPU form of the table path (tests/gpu/test_table_decode_cuda.py runs it on the GPU)")
    load_kernels("ferrylm.experts.kernels.fused_moe")  # skips without Triton / the interpreter
    monkeypatch.setattr(OffloadExecutor, "table_on_cpu", True)


def _trace(model, executor, prompt: list[int], new_tokens: int):
    """Prefill the prompt (one chunk), then decode greedily; ``executor.begin_step`` before every step, as the
    model runner calls it."""
    cache = SequenceCacheAttention()
    out, trace = [], []
    with torch.inference_mode():
        if executor is not None:
            executor.begin_step(len(prompt))
        hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), cache)
        logits = model.compute_logits(hidden[-1:])[0]
        pos = len(prompt)
        for _ in range(new_tokens):
            tok = int(torch.argmax(logits))
            out.append(tok)
            trace.append(logits)
            if executor is not None:
                executor.begin_step(1)
            hidden = model(torch.tensor([tok]), torch.tensor([pos]), cache)
            logits = model.compute_logits(hidden)[0]
            pos += 1
    return out, trace


def _table_consistent(ex) -> None:
    """Every table entry is the expert's slot row (cached) or its bank row (not cached)."""
    t = ex.table
    ref = t.ref.data_ptr()
    for i, layer in enumerate(t.layers):
        for e in range(ex.num_experts):
            slot = ex.cache.slot_of((layer, e))
            want = ex.banks.row(layer, e).data_ptr() - ref if slot is None else ex.slots.row(slot).data_ptr() - ref
            assert int(t.host_np[i, e]) == want, (layer, e, slot)
            assert int(t.table[i, e]) == want, (layer, e, slot)


@pytest.mark.parametrize("case", [c for c in ("qwen3_moe", "mixtral") if c in CASES])
@pytest.mark.parametrize("slots", ["small", "all"])
def test_table_decode_equals_resident(expert_checkpoints, table_on_cpu, case, slots):
    ckpt = expert_checkpoints(case)
    prompt = token_ids(9, ckpt.vocab_size, seed=3).tolist()
    ref = _trace(load_model(ckpt.path).model, None, prompt, NEW_TOKENS)
    import json
    cfg = json.loads((ckpt.path / "config.json").read_text())
    size = cfg["num_experts_per_tok"] + 1 if slots == "small" else None
    loaded = load_model(ckpt.path, moe_backend=options("offload", size, stream_prefill=False))
    ex = loaded.executor
    ex.reserve(None)
    assert ex.table is not None, "the table path is on"
    got = _trace(loaded.model, ex, prompt, NEW_TOKENS)
    assert got[0] == ref[0], "greedy tokens differ from resident"
    err = max((a - b).abs().max().item() for a, b in zip(got[1], ref[1]))
    assert err <= TOL, err
    ex.begin_step(1)  # folds the last step's routing in
    s = ex.stats().as_dict()
    assert s["hits"] + s["misses"] == s["needed"] > 0
    assert s["mapped"] == s["misses"] and s["bytes_mapped"] == s["misses"] * s["expert_bytes"]
    if slots == "all":
        assert s["misses"] == 0 and s["fetched"] == 0
    else:
        assert s["misses"] > 0
    ex.cache.check()
    _table_consistent(ex)


def test_installs_follow_reuse_not_one_off_misses(expert_checkpoints, table_on_cpu):
    """Admission: an expert missed once is not installed; one used again and again is (TinyLFU rule over the LRU
    victim); the table follows every change."""
    ckpt = expert_checkpoints("mixtral")
    loaded = load_model(ckpt.path, moe_backend=options("offload", 2, stream_prefill=False))
    ex = loaded.executor
    ex.reserve(None)
    t = ex.table
    layer = t.layers[0]
    k = 2

    def step(ids_first_layer):
        # a fake finished step: only the routing mirror matters to begin_step
        ids = np.zeros((1, len(t.layers), k), dtype=np.int64)
        ids[0, :, :] = ids_first_layer
        t.routed_np = ids.copy() if t.routed_np is None else t.routed_np
        t.routed_np[:1] = ids
        t.recorded = 1
        ex.begin_step(1)

    cached = {e for (lay, e) in ex.cache._slot_of if lay == layer}
    fresh = [e for e in range(ex.num_experts) if e not in cached]
    hot, one_offs = fresh[0], fresh[1:]
    assert len(one_offs) >= 5
    step([one_offs[0], one_offs[1]])  # first sight of both: not installed
    assert (layer, one_offs[0]) not in ex.cache and (layer, one_offs[1]) not in ex.cache
    for j in range(4):  # `hot` comes back every step beside a different one-off expert
        step([hot, one_offs[2 + j]])
    assert (layer, hot) in ex.cache
    assert not any((layer, e) in ex.cache for e in one_offs[:6])
    ex.cache.check()
    _table_consistent(ex)


def test_shrink_rebuilds_the_table(expert_checkpoints, table_on_cpu):
    ckpt = expert_checkpoints("mixtral")
    loaded = load_model(ckpt.path, moe_backend=options("offload", None, stream_prefill=False))
    ex = loaded.executor
    ex.reserve(None)
    before = len(ex.cache)
    freed = ex.shrink_slots(3)
    assert freed > 0 and len(ex.cache) < before
    ex.begin_step(1)
    _table_consistent(ex)


def test_table_decode_step_reads_nothing_back(expert_checkpoints, table_on_cpu, monkeypatch):
    """The CPU form of the GPU's no-sync test: during a table step's forward no ferrylm code reads a tensor back to
    the host (``tolist`` / ``item`` / ``__bool__`` / ``numpy`` / ``cpu``), which on a GPU would be a device sync; the
    host-planned path does (one read per layer), so the counter is shown to work on it."""
    import inspect

    ckpt = expert_checkpoints("mixtral")
    loaded = load_model(ckpt.path, moe_backend=options("offload", 3, stream_prefill=False))
    ex = loaded.executor
    ex.reserve(None)
    reads: list[str] = []

    def counting(name):
        orig = getattr(torch.Tensor, name)

        def wrapper(self, *a, **kw):
            caller = inspect.currentframe().f_back
            if caller is not None and "/ferrylm/" in caller.f_code.co_filename.replace("\\", "/") \
                    and "/tests/" not in caller.f_code.co_filename:
                reads.append(f"{name} in {caller.f_code.co_filename.rsplit('/', 1)[-1]}:{caller.f_lineno}")
            return orig(self, *a, **kw)
        return wrapper

    cache = SequenceCacheAttention()
    prompt = token_ids(6, ckpt.vocab_size, seed=1).tolist()
    with torch.inference_mode():
        ex.begin_step(len(prompt))
        loaded.model(torch.tensor(prompt), torch.arange(len(prompt)), cache)
        for name in ("tolist", "item", "__bool__", "numpy", "cpu"):
            monkeypatch.setattr(torch.Tensor, name, counting(name))
        for pos in range(len(prompt), len(prompt) + 3):
            ex.begin_step(1)  # host work between steps: allowed
            reads.clear()
            loaded.model(torch.tensor([5]), torch.tensor([pos]), cache)
            assert reads == [], reads
        ex.table = None  # the host-planned path: it reads the step's ids once per layer
        reads.clear()
        loaded.model(torch.tensor([5]), torch.tensor([len(prompt) + 3]), cache)
        assert any(r.startswith("tolist") for r in reads), reads
