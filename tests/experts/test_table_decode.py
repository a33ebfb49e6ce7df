"""The offload backend's table path (experts/slot_table.py): decode steps from a device table of expert row offsets,
misses installed into each layer's slot pool by the device inside the step (experts/device_pools.py), the host cache
brought in step between steps. On the CPU the kernels run in Triton's interpreter (``table_on_cpu``); greedy tokens
and logits equal the resident backend's, the cache bookkeeping stays consistent, and the table always points every
expert at the row that holds it."""

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
    """Every device table entry is the expert's slot row (cached) or its bank row (not cached), and every slot row
    holds the weights of the expert the host cache says it holds."""
    t = ex.table
    ref = t.ref.data_ptr()
    for i, layer in enumerate(t.layers):
        for e in range(ex.num_experts):
            slot = ex.cache.slot_of((layer, e))
            want = ex.banks.row(layer, e).data_ptr() - ref if slot is None else ex.slots.row(slot).data_ptr() - ref
            assert int(t.table[i, e]) == want, (layer, e, slot)
            if slot is not None:
                assert torch.equal(ex.slots.row(slot), ex.banks.row(layer, e)), (layer, e, slot)


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
    assert s["mapped"] <= s["misses"] <= s["mapped"] + s["fetched"]
    assert s["bytes_mapped"] == s["mapped"] * s["expert_bytes"]
    if slots == "all":
        assert s["misses"] == 0 and s["fetched"] == 0
    else:
        assert s["misses"] > 0 and s["fetched"] > 0
    ex.cache.check()
    _table_consistent(ex)


def test_device_installs_are_layer_lru(expert_checkpoints, table_on_cpu):
    """A step's missed experts are installed by the device into their layer's pool, least recently used slot first
    (a slot used in the same step is never the victim); the host cache follows at the next step's begin, and the
    table and slot rows agree with it."""
    ckpt = expert_checkpoints("mixtral")
    loaded = load_model(ckpt.path, moe_backend=options("offload", 4, stream_prefill=False))
    ex = loaded.executor
    ex.reserve(None)
    t = ex.table
    i, layer = 0, t.layers[0]
    pool = [int(s) for s in ex.pools.slot_ids[i] if s >= 0]
    assert len(pool) == 2, "4 slots, 2 MoE layers: a pool of 2 each"
    hidden = torch.randn(1, loaded.model.config.hidden_size)

    def step(ids):
        ex.begin_step(1)
        for row, lay in enumerate(t.layers):
            topk = torch.tensor([ids if row == i else [0, 1]])
            ex.run(lay, hidden, topk, torch.full((1, 2), 0.5))
        ex.begin_step(1)  # the host reads the device's installs

    cached = sorted(e for (lay, e), _ in ex.cache.placements() if lay == layer)
    fresh = [e for e in range(ex.num_experts) if e not in cached]
    with torch.inference_mode():
        step([cached[0], fresh[0]])  # hit + miss: the miss takes the other slot (its expert was not used)
        assert sorted(e for (lay, e), _ in ex.cache.placements() if lay == layer) == sorted([cached[0], fresh[0]])
        step([fresh[1], fresh[2]])  # two misses: both slots turn over
        assert sorted(e for (lay, e), _ in ex.cache.placements() if lay == layer) == sorted([fresh[1], fresh[2]])
        step([fresh[1], fresh[3]])  # the hit's slot stays, the miss evicts the other
        assert sorted(e for (lay, e), _ in ex.cache.placements() if lay == layer) == sorted([fresh[1], fresh[3]])
    s = ex.stats().as_dict()
    assert s["fetched"] >= 4 and s["mapped"] <= s["misses"] <= s["mapped"] + s["fetched"]
    ex.cache.check()
    _table_consistent(ex)


def test_an_expert_that_moved_between_slots_is_followed(expert_checkpoints, table_on_cpu):
    """Several device steps between two host reads (warmups, captures) can move an expert from one slot to another;
    the host cache follows whatever the order of the changed slots."""
    ckpt = expert_checkpoints("mixtral")
    loaded = load_model(ckpt.path, moe_backend=options("offload", 4, stream_prefill=False))
    ex = loaded.executor
    ex.reserve(None)
    layer = ex.table.layers[0]
    hidden = torch.randn(1, loaded.model.config.hidden_size)
    r0, r1 = sorted(e for (lay, e), _ in ex.cache.placements() if lay == layer)
    x, y = [e for e in range(ex.num_experts) if e not in (r0, r1)][:2]

    def run(ids):
        ex.run(layer, hidden, torch.tensor([ids]), torch.full((1, 2), 0.5))

    with torch.inference_mode():
        run([r0, x])  # x takes r1's slot
        ex.settle_device()
        assert ex.cache.slot_of((layer, x)) is not None and ex.cache.slot_of((layer, r1)) is None
        run([r0, y])  # y takes x's slot
        run([y, x])   # x comes back in r0's slot
        ex.settle_device()
    assert sorted(e for (lay, e), _ in ex.cache.placements() if lay == layer) == sorted([x, y])
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


@pytest.mark.parametrize("prefetch", [True, False])
def test_table_steps_install_misses_on_demand(expert_checkpoints, table_on_cpu, prefetch):
    """Table steps predict nothing, whatever the prefetch option (it is the host-planned path's): with routers that
    name the next layer's experts exactly, that layer's experts are still its own misses, installed by the layer
    and read from its slots. Nothing is mapped (the pool has room)."""
    ckpt = expert_checkpoints("mixtral")
    loaded = load_model(ckpt.path, moe_backend=options("offload", 4, stream_prefill=False, prefetch=prefetch))
    ex = loaded.executor
    ex.reserve(None)
    t = ex.table
    first, second = t.layers[0], t.layers[1]
    cached = {lay: sorted(e for (la, e), _ in ex.cache.placements() if la == lay) for lay in t.layers}
    fresh = [e for e in range(ex.num_experts) if e not in cached[second]][:2]
    route = {first: cached[first], second: fresh}
    ex.use_routers({lay: (lambda h, ids=ids: torch.tensor([ids] * h.shape[0])) for lay, ids in route.items()})
    hidden = torch.randn(1, loaded.model.config.hidden_size)
    with torch.inference_mode():
        ex.begin_step(1)
        for lay in t.layers:
            ex.run(lay, hidden, torch.tensor([route[lay]]), torch.full((1, 2), 0.5))
        ex.begin_step(1)
    s = ex.stats().as_dict()
    assert sorted(e for (la, e), _ in ex.cache.placements() if la == second) == sorted(fresh)
    assert s["needed"] == 4 and s["mapped"] == 0 and s["fetched"] == 2
    assert (s["prefetched"], s["prefetch_hits"], s["misses"]) == (0, 0, 2)
    ex.cache.check()
    _table_consistent(ex)
