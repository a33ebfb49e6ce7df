"""The warmup on the engine's own pool (the boot's settle step on CUDA) fits the pool it is given: an explicit
``--num-pages`` smaller than the prefill chunk warms up at the pool's size instead of failing the boot."""

from __future__ import annotations

from tests.models.hf_checkpoints import build_checkpoint

from ferrylm.config import EngineConfig
from ferrylm.engine.boot import build_engine
from ferrylm.engine.profile import WarmupShape, fit_to_pages, warm_up


def test_fit_to_pages_cuts_from_the_end():
    prompts = [list(range(40)), list(range(40)), list(range(40))]
    got = fit_to_pages(prompts, free_pages=4, page_size=16)   # 64 tokens: one 40 + 1, then 23 - 1 = 22 + 1
    assert [len(p) for p in got] == [40, 15]
    assert fit_to_pages([[1, 2]], free_pages=1, page_size=16) == [[1, 2]]


def test_warmup_at_a_chunk_larger_than_the_pool(tmp_path):
    ckpt = build_checkpoint("qwen3_moe", tmp_path / "m", seed=3)
    engine = build_engine(ckpt.path, EngineConfig(device="cpu", dtype="float32", page_size=16, num_pages=8,
                                                  max_prefill_length=2048, max_running_requests=4))
    free = engine.pool.allocator.num_free
    warm_up(engine.runner, engine.pool, engine.state_pool, WarmupShape(2048, 4, 2048, 4),
            engine.mcfg.vocab_size, engine.progress)
    assert engine.pool.allocator.num_free == free
