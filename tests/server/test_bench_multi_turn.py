"""``ferry bench serve --multi-turn`` (issue 23) against the ASGI app with a scripted engine that emulates a prefix
cache: every turn re-sends the history plus the answer the server generated, the system prefix is shared across
conversations, and the summary records TTFT and cached tokens per turn."""

from __future__ import annotations

import httpx
import pytest

from ferrylm.bench.multi_turn import MultiTurnConfig, format_multi_turn, run_multi_turn
from ferrylm.cli import build_parser
from ferrylm.server.api.app import create_app

from .conftest import SERVED, FakeEngine

pytestmark = pytest.mark.anyio


async def test_multi_turn_resends_history_and_records_cached_tokens(codec) -> None:
    eng = FakeEngine(codec, max_model_len=4096, prefix_pages=4)
    eng.script = lambda rid, ids, p: [(sum(ids) + i) % 300 + 5 for i in range(100)]   # depends on the prompt
    transport = httpx.ASGITransport(app=create_app(eng, codec, SERVED))
    cfg = MultiTurnConfig(base_url="http://test", model=None, num_conversations=2, num_turns=3,
                          shared_prefix_len=20, input_len=6, output_len=3, vocab_upper=300)
    s = await run_multi_turn(cfg, transport=transport)
    assert s["completed"] == 6 and s["failed"] == 0
    prompts = {rid: ids for rid, ids, _ in eng.requests}
    assert len(prompts) == 6
    firsts = [ids for ids in prompts.values() if len(ids) == 26]
    assert len(firsts) == 2 and firsts[0][:20] == firsts[1][:20] and firsts[0][20:] != firsts[1][20:]
    # each later prompt = an earlier prompt + that turn's generated ids + 6 new ids
    for ids in prompts.values():
        if len(ids) == 26:
            continue
        prev = next(p for p in prompts.values() if len(p) == len(ids) - 9 and ids[:len(p)] == p)
        assert ids[len(prev):len(prev) + 3] == eng.script("", prev, None)[:3]
    turns = s["turns"]
    assert [t["turn"] for t in turns] == [0, 1, 2]
    assert turns[0]["prompt_tokens_mean"] == 26 and turns[2]["prompt_tokens_mean"] == 44
    assert turns[1]["cached_tokens_mean"] > turns[0]["cached_tokens_mean"]
    assert turns[2]["cached_tokens_mean"] > turns[1]["cached_tokens_mean"]
    assert 0 < turns[2]["cached_fraction"] < 1 and turns[0]["ttft_vs_first_turn"] == 1.0
    reqs = s["requests"]
    assert len(reqs) == 6 and all(r["ok"] and r["ttft_ms"] > 0 for r in reqs)
    assert "cached%" in format_multi_turn(s)


def test_multi_turn_flags_parse() -> None:
    a = build_parser().parse_args(["bench", "serve", "--multi-turn", "--num-conversations", "4", "--num-turns", "8",
                                   "--shared-prefix-len", "20000"])
    assert a.multi_turn and (a.num_conversations, a.num_turns, a.shared_prefix_len) == (4, 8, 20000)
