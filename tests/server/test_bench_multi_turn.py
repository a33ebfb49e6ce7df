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
    assert [t["turn"] for t in turns] == [1, 2, 3]
    assert turns[0]["prompt_tokens_mean"] == 26 and turns[2]["prompt_tokens_mean"] == 44
    assert turns[1]["cached_tokens_mean"] > turns[0]["cached_tokens_mean"]
    assert turns[2]["cached_tokens_mean"] > turns[1]["cached_tokens_mean"]
    assert 0 < turns[2]["cached_fraction"] < 1
    reqs = s["requests"]
    assert len(reqs) == 6 and all(r["ok"] and r["ttft_ms"] > 0 for r in reqs)
    # the ratios are medians against turn 1's median, per turn and for turns 2..3 pooled
    first = turns[0]["ttft_ms"]["p50"]
    assert turns[0]["ttft_p50_vs_turn_1"] == 1.0
    assert turns[2]["ttft_p50_vs_turn_1"] == pytest.approx(turns[2]["ttft_ms"]["p50"] / first)
    later = sorted(r["ttft_ms"] for r in reqs if r["turn"] > 1)
    lt = s["later_turns"]
    assert lt["completed"] == 4 and lt["ttft_ms_p50"] == later[1]
    assert lt["ttft_p50_vs_turn_1"] == pytest.approx(later[1] / first)
    cached = sum(r["cached_tokens"] for r in reqs if r["turn"] > 1)
    assert lt["cached_fraction"] == pytest.approx(cached / sum(r["prompt_tokens"] for r in reqs if r["turn"] > 1))
    table = format_multi_turn(s)
    assert "cached%" in table and "p50 / turn 1" in table
    assert f"turns 2..3: TTFT p50 {lt['ttft_ms_p50']:.1f} ms = {lt['ttft_p50_vs_turn_1']:.3f} x turn 1" in table


def test_summary_without_a_successful_first_turn_has_no_ratios() -> None:
    from ferrylm.bench.multi_turn import TurnResult, summarize
    from ferrylm.bench.serve import RequestResult

    cfg = MultiTurnConfig(base_url="http://test", model=None, num_conversations=1, num_turns=2,
                          shared_prefix_len=0, input_len=1, output_len=1)
    turns = [TurnResult(0, 1, RequestResult(ok=False, error="boom")),
             TurnResult(0, 2, RequestResult(ok=True, ttft=0.5, prompt_tokens=10, cached_tokens=4))]
    s = summarize(cfg, "m", turns, 1.0)
    assert [t["turn"] for t in s["turns"]] == [2] and s["turns"][0]["ttft_p50_vs_turn_1"] is None
    assert s["later_turns"]["ttft_p50_vs_turn_1"] is None and s["later_turns"]["cached_fraction"] == 0.4
    assert "FAILED 1" in format_multi_turn(s) and " - x turn 1" in format_multi_turn(s)


def test_multi_turn_flags_parse() -> None:
    a = build_parser().parse_args(["bench", "serve", "--multi-turn", "--num-conversations", "4", "--num-turns", "8",
                                   "--shared-prefix-len", "20000"])
    assert a.multi_turn and (a.num_conversations, a.num_turns, a.shared_prefix_len) == (4, 8, 20000)
