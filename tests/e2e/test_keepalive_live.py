"""Keep-alive while a prompt prefills, end to end: ``ferry serve --model smollm2-135m --sse-ping-interval 0.2``
with every prefill step slowed to ~1 s (``step_delay``, 35 ms per decoder layer). Each streaming route sends
its headers and first byte at once and a keep-alive at least every interval until the first token; the real SDKs'
streams give the text of the non-stream reply (greedy)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import start_server, stop_server
from tests.server.test_keepalive import PING_S, SLACK_S, is_keepalive, timed_blocks

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
MAX_TOKENS = 4
LAYERS = 30                 # smollm2-135m's decoder layers
DELAY_MS = 35               # per layer of a prefill step: ~1 s to the first token (5 keep-alive intervals)
MSGS = [{"role": "user", "content": "What is the capital of France?"}]
ROUTES = {
    "chat": ("/v1/chat/completions", {"messages": MSGS, "max_tokens": MAX_TOKENS}),
    "completions": ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": MAX_TOKENS}),
    "messages": ("/v1/messages", {"messages": MSGS, "max_tokens": MAX_TOKENS}),
    "responses": ("/v1/responses", {"input": MSGS[0]["content"], "max_output_tokens": MAX_TOKENS}),
}


def opening(block: str) -> bool:
    """A route's opening event, sent before any token (chat's role delta, the Responses API's first two)."""
    return '"delta":{"role":"assistant","content":""}' in block or \
        block.startswith(("event: response.created", "event: response.in_progress"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # no prefix cache: each route's request prefills its whole prompt (a cached prompt's one-token step is short)
    srv = start_server(tmp_path_factory.mktemp("keepalive"), "--model", MODEL, "--sse-ping-interval", str(PING_S),
                       "--faults", f"step_delay:phase=prefill:ms={DELAY_MS}", "--no-enable-prefix-caching")
    yield srv
    stop_server(srv)


def _oai(srv) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0, timeout=120)


def _chat(srv) -> tuple[str, str]:
    kw = dict(model=MODEL, messages=MSGS, max_tokens=MAX_TOKENS, temperature=0)
    stream = _oai(srv).chat.completions.create(**kw, stream=True)
    return ("".join(c.choices[0].delta.content or "" for c in stream if c.choices),
            _oai(srv).chat.completions.create(**kw).choices[0].message.content)


def _completions(srv) -> tuple[str, str]:
    kw = dict(model=MODEL, prompt=ROUTES["completions"][1]["prompt"], max_tokens=MAX_TOKENS, temperature=0)
    stream = _oai(srv).completions.create(**kw, stream=True)
    return "".join(c.choices[0].text for c in stream if c.choices), _oai(srv).completions.create(**kw).choices[0].text


def _messages(srv) -> tuple[str, str]:
    client = anthropic.Anthropic(base_url=srv.base_url, api_key="x", max_retries=0, timeout=120)
    kw = dict(model=MODEL, messages=MSGS, max_tokens=MAX_TOKENS, extra_body={"temperature": 0})
    with client.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
    return text, client.messages.create(**kw).content[0].text


def _responses(srv) -> tuple[str, str]:
    kw = dict(model=MODEL, input=MSGS[0]["content"], max_output_tokens=MAX_TOKENS, temperature=0)
    stream = _oai(srv).responses.create(**kw, stream=True)
    return ("".join(e.delta for e in stream if e.type == "response.output_text.delta"),
            _oai(srv).responses.create(**kw).output_text)


SDK = {"chat": _chat, "completions": _completions, "messages": _messages, "responses": _responses}


@pytest.mark.parametrize("name", list(ROUTES))
def test_live_stream_keeps_alive_through_a_slow_prefill(server, name: str) -> None:
    """Raw bytes: headers and a first byte at once, then never a silence of a whole interval more until the first
    token. Through the route's SDK: the stream's text is the non-stream reply's."""
    path, body = ROUTES[name]
    body = {"model": MODEL, "temperature": 0, "stream": True, **body}
    t_headers, blocks = timed_blocks(server.base_url, path, body)
    first = next(i for i, (_, b) in enumerate(blocks) if not is_keepalive(b) and not opening(b))
    t_token, before = blocks[first][0], blocks[:first]
    assert t_token > LAYERS * DELAY_MS / 1000 * 0.9, blocks[:first + 1]
    assert t_headers < SLACK_S and before[0][0] < SLACK_S, (t_headers, before[:2])
    times = [0.0] + [t for t, _ in before] + [t_token]
    assert max(b - a for a, b in zip(times, times[1:])) < PING_S + SLACK_S, times
    streamed, whole = SDK[name](server)
    assert streamed == whole and whole
