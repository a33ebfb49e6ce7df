"""Agent prompt hygiene (issue 23): Claude Code's per-request billing-header line is dropped from the top of the
system prompt, so consecutive turns render the same prompt prefix; Codex's ``prompt_cache_key`` is accepted."""

from __future__ import annotations

import pytest

from ferrylm.server.api.app import create_app
from ferrylm.server.text.prompt_hygiene import strip_billing_header

from .conftest import SERVED, FakeEngine, make_client

pytestmark = pytest.mark.anyio

HEADER = "x-anthropic-billing-header: cc_version=2.1.100.7b4; cc_entrypoint=cli; cch={};"
SYSTEM = "You are Claude Code, a helpful assistant."


def test_strip_billing_header_only_at_the_top() -> None:
    assert strip_billing_header(HEADER.format("eb6c6") + "\n" + SYSTEM) == SYSTEM
    assert strip_billing_header(HEADER.format("eb6c6")) == ""
    assert strip_billing_header(SYSTEM) == SYSTEM
    inside = SYSTEM + "\n" + HEADER.format("1")
    assert strip_billing_header(inside) == inside, "a header line past the top is the user's text"


async def test_anthropic_turns_with_new_billing_hashes_render_the_same_prompt(codec) -> None:
    eng = FakeEngine(codec, max_model_len=4096)
    async with make_client(create_app(eng, codec, SERVED)) as c:
        counts = []
        for cch, system in (("eb6c6", [{"type": "text", "text": HEADER.format("eb6c6")},
                                       {"type": "text", "text": SYSTEM}]),
                            ("71fea", HEADER.format("71fea") + "\n" + SYSTEM),
                            (None, SYSTEM)):
            body = {"model": SERVED, "max_tokens": 4, "system": system,
                    "messages": [{"role": "user", "content": "hi"}]}
            r = await c.post("/v1/messages", json=body)
            assert r.status_code == 200, r.text
            counts.append((await c.post("/v1/messages/count_tokens", json=body)).json()["input_tokens"])
    prompts = [ids for _, ids, _ in eng.requests]
    assert prompts[0] == prompts[1] == prompts[2]
    assert "billing" not in codec.decode(prompts[0], skip_special_tokens=False)
    assert counts[0] == counts[1] == counts[2] == len(prompts[0])


async def test_prompt_cache_key_is_accepted(client, engine: FakeEngine) -> None:
    r = await client.post("/v1/chat/completions", json={"model": SERVED, "messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 2, "prompt_cache_key": "session-42"})
    assert r.status_code == 200, r.text
    r = await client.post("/v1/responses", json={"model": SERVED, "input": "hi", "max_output_tokens": 2,
                                                 "prompt_cache_key": "session-42"})
    assert r.status_code == 200, r.text
