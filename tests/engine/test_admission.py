"""One admission rule (engine/admission.py) for the server and the engine: the same request gets the same
max_tokens, or the same refusal, from both."""

from __future__ import annotations

import pytest

from ferrylm.engine.admission import admit
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.errors import ContextLengthExceeded, InvalidRequest
from tests.engine.test_structured_and_prompt_logprobs import make


def test_the_engine_bounds_an_open_request_by_the_pool_as_the_server_does():
    eng = make(32)   # fake model: context 512, pool 64 pages x 4 = 256 tokens
    params = SamplingParams(max_tokens=None)
    eng.add_request("open", [1] * 100, params)
    lim = eng.limits
    assert params.max_tokens == admit(100, None, max_model_len=lim.max_model_len, pool_tokens=lim.pool_tokens)
    assert params.max_tokens == 256 - 100   # the rest of the pool, not of the context (512 - 100)


@pytest.mark.parametrize(("prompt", "max_tokens", "error"), [
    (0, None, InvalidRequest), (512, None, ContextLengthExceeded), (300, None, ContextLengthExceeded),
    (100, 500, ContextLengthExceeded)])
def test_refusals(prompt, max_tokens, error):
    with pytest.raises(error):
        admit(prompt, max_tokens, max_model_len=512, pool_tokens=256)


def test_a_default_is_clipped_to_the_room_and_never_below_one():
    assert admit(10, None, max_model_len=512, pool_tokens=0, default_max=16) == 16
    assert admit(250, None, max_model_len=512, pool_tokens=256, default_max=16) == 6
    assert admit(255, None, max_model_len=512, pool_tokens=256, default_max=16) == 1
