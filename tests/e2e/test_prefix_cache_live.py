"""Prefix caching end to end (issue 23): multi-turn conversations through the real ``openai`` and ``anthropic``
clients against ``ferry serve`` with the built-in model (the prefix cache on by default); the cached tokens grow
turn by turn and the prefix-cache metrics count them. Short turns: a few generated tokens each."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.slow

MODEL = "smollm2-moe"
SYSTEM = ("You are a careful coding assistant working in a large repository. Read the files you are given, answer "
          "briefly, and never invent APIs. ") * 4


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)  # labels (model_name) allowed
    assert m, name
    return float(m.group(1))


def test_openai_and_anthropic_cached_tokens_grow_turn_by_turn(default_server) -> None:
    base = default_server.base_url
    before = httpx.get(f"{base}/metrics").text
    oai = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    history = [{"role": "system", "content": SYSTEM}]
    cached = []
    for turn in range(3):
        history.append({"role": "user", "content": f"Question {turn}: what does the function on line {turn} do?"})
        resp = oai.chat.completions.create(model=MODEL, messages=history, max_tokens=4, temperature=0)
        cached.append(resp.usage.prompt_tokens_details.cached_tokens)
        assert cached[-1] < resp.usage.prompt_tokens
        history.append({"role": "assistant", "content": resp.choices[0].message.content})
    assert cached[1] > 0 and cached[2] > cached[1], cached

    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.100.7b4; cc_entrypoint=cli; "
                                      "cch={};"}, {"type": "text", "text": SYSTEM}]
    messages: list[dict] = []
    reads = []
    for turn, cch in enumerate(["eb6c6", "71fea", "0a1b2"]):   # a new billing hash every turn, as Claude Code
        messages.append({"role": "user", "content": f"Question {turn}: which file holds the tests?"})
        blocks = [dict(system[0], text=system[0]["text"].format(cch)), system[1]]
        msg = client.messages.create(model=MODEL, max_tokens=4, system=blocks, messages=messages)
        reads.append(msg.usage.cache_read_input_tokens)
        text = "".join(b.text for b in msg.content if b.type == "text")   # no block for an empty reply
        messages.append({"role": "assistant", "content": text or "ok"})
    # the system prompt (shared with the chat turns above, billing line dropped) is cached from the first turn
    assert reads[0] > 0 and reads[2] > reads[1] > reads[0], reads

    # the engine's counters reach /metrics with its heartbeat (every 0.5 s): read until the last turn is in
    deadline = time.monotonic() + 10
    while True:
        after = httpx.get(f"{base}/metrics").text
        hits = _metric(after, "ferrylm:prefix_cache_hits_total") - _metric(before, "ferrylm:prefix_cache_hits_total")
        if hits >= sum(cached) + sum(reads) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert hits >= sum(cached) + sum(reads)   # other tests on the same server only add to it
    assert 0 < _metric(after, "ferrylm:prefix_cache_hit_rate") <= 1


def test_bench_serve_multi_turn(default_server, tmp_path) -> None:
    import subprocess
    import sys

    out = tmp_path / "mt.json"
    r = subprocess.run([sys.executable, "-m", "ferrylm.cli", "bench", "serve", "--port", str(default_server.port),
                        "--multi-turn", "--num-conversations", "2", "--num-turns", "3", "--shared-prefix-len", "48",
                        "--input-len", "8", "--output-len", "4", "--output-json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(out.read_text())
    assert s["failed"] == 0 and s["completed"] == 6
    turns = s["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    assert turns[2]["cached_tokens_mean"] > turns[1]["cached_tokens_mean"] > 0
    assert turns[2]["cached_fraction"] > 0.5
    assert all(t["ttft_ms"]["p50"] > 0 and t["ttft_p50_vs_turn_1"] > 0 for t in turns)
    assert turns[0]["ttft_p50_vs_turn_1"] == 1.0
    later = s["later_turns"]
    assert later["completed"] == 4 and later["ttft_ms_p50"] > 0 and later["ttft_p50_vs_turn_1"] > 0
    assert later["cached_fraction"] > 0.5
    assert "p50 / turn 1" in r.stdout and "turns 2..3: TTFT p50" in r.stdout
