"""Offline API: LLM(model).generate(prompts, SamplingParams) batches many prompts in one engine."""

from __future__ import annotations

import pytest

from ferrylm import LLM, SamplingParams
from ferrylm.errors import ContextLengthExceeded

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m", num_tokens=2048)


def test_generate_many_prompts_matches_one_by_one(llm):
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    together = llm.generate(prompts, greedy)
    assert [o.prompt for o in together] == prompts
    for p, out in zip(prompts, together):
        alone = llm.generate(p, greedy)[0].outputs[0]
        assert out.outputs[0].token_ids == alone.token_ids and len(alone.token_ids) == 6
        assert out.outputs[0].text == alone.text and out.outputs[0].finish_reason == "length"
    assert "Paris" in together[0].outputs[0].text


def test_n_seed_and_stop(llm):
    outs = llm.generate("Once upon a time", SamplingParams(temperature=1.0, n=3, seed=1, max_tokens=8))[0].outputs
    assert [o.index for o in outs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in outs}) > 1  # choices differ
    again = llm.generate("Once upon a time", SamplingParams(temperature=1.0, n=3, seed=1, max_tokens=8))[0].outputs
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]  # seeded: reproducible
    stopped = llm.chat([[{"role": "user", "content": "What is the capital of France?"}]],
                       SamplingParams(temperature=0.0, max_tokens=20, stop=["Paris"]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and "Paris" not in stopped.text


def test_too_long_prompt_raises(llm):
    with pytest.raises(ContextLengthExceeded):
        llm.generate([list(range(100, 2200))], SamplingParams(max_tokens=4))
    assert not llm.engine.has_work()
