"""Fixtures for tests/memory: a tiny Mixtral checkpoint (transformers' save_pretrained) and the model loaded with
the offload backend and a 4-slot expert cache (so the expert-fetch fault point is on the path), CPU only."""

from __future__ import annotations

import time

import pytest
import torch

from ferrylm.config import EngineConfig
from ferrylm.engine.boot import engine_for_model
from ferrylm.engine.engine import Engine
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.experts import ExpertOptions
from ferrylm.faults import FaultInjector
from tests.models.hf_checkpoints import build_checkpoint

VOCAB = 128
LONG = [3 + (7 * i) % 120 for i in range(200)]    # 200 tokens: > the 128-token halving floor
MID = [5 + (11 * i) % 110 for i in range(100)]    # 100 tokens
SHORT = [4 + (5 * i) % 100 for i in range(20)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core CI machine, torch's spinning thread pool costs seconds per test."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def mixtral_dir(tmp_path_factory):
    return build_checkpoint("mixtral", tmp_path_factory.mktemp("mixtral"), seed=3).path


@pytest.fixture(scope="session")
def offload_model(mixtral_dir):
    from ferrylm.checkpoints.loader import load_model

    loaded = load_model(mixtral_dir, device="cpu", dtype=torch.float32,
                        moe_backend=ExpertOptions(backend="offload", cache_size=4))
    yield loaded
    loaded.executor.close()


@pytest.fixture(autouse=True)
def _restore_expert_slots(request):
    """The shared offload model's expert cache is given back its slots after each test (the OOM guard's shrink
    rung takes some), so no test sees what the tests before it did to it."""
    if "offload_model" not in request.fixturenames:
        yield
        return
    ex = request.getfixturevalue("offload_model").executor
    before = ex.cache.num_slots if ex.cache is not None else None
    yield
    if before is not None and ex.cache is not None and ex.cache.num_slots < before:
        ex.grow_slots(before - ex.cache.num_slots)


def make_engine(loaded, spec: str | None = None, *, guard=None, prefill: int = 256, running: int = 4,
                pages: int = 64) -> Engine:
    cfg = EngineConfig(device="cpu", page_size=16, num_pages=pages, max_running_requests=running,
                       max_prefill_length=prefill, check_invariants=True)
    return engine_for_model(loaded.model, loaded.config, cfg, device=torch.device("cpu"), dtype=torch.float32,
                  expert_executor=loaded.executor, faults=FaultInjector.parse(spec), guard=guard)


def greedy(n: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run(engine: Engine, prompts: dict[str, list[int]], max_tokens: int = 6, deadline_s: float = 60.0) -> dict:
    """Run ``prompts`` to the end; ``{rid: {"tokens", "error", "message", "finish", "seconds"}}``."""
    t0 = time.monotonic()
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, greedy(max_tokens))
    return drain(engine, t0, deadline_s)


def drain(engine: Engine, t0: float, deadline_s: float = 60.0, res: dict | None = None) -> dict:
    res = {} if res is None else res
    while engine.has_work():
        assert time.monotonic() - t0 < deadline_s, "the engine did not finish in time"
        for o in engine.step():
            r = res.setdefault(o.request_id, {"tokens": [], "error": None, "message": "", "finish": None})
            r["tokens"] += o.new_token_ids
            if o.error_code:
                r["error"], r["message"] = o.error_code, o.error_message
            if o.finished:
                r["finish"], r["seconds"] = o.finish_reason, time.monotonic() - t0
    assert engine.pool.allocator.num_free == engine.pool.num_pages, "KV pages leaked"
    return res


@pytest.fixture(scope="session")
def reference(offload_model):
    """Greedy outputs without faults."""
    res = run(make_engine(offload_model), {"long": LONG, "mid": MID, "short": SHORT})
    return {k: v["tokens"] for k, v in res.items()}
