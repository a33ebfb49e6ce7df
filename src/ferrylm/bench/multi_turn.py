"""``ferry bench serve --multi-turn``: agent-like conversations against a running server.

``--num-conversations`` conversations run at once, each ``--num-turns`` turns in sequence. Every conversation
starts with the same system prefix of ``--shared-prefix-len`` token ids (shared across conversations), then a
user message of ``--input-len`` ids of its own; each later turn re-sends the whole history, the previous answer
(the ids the server generated, asked for with ``return_token_ids``) and a new user message of ``--input-len``
ids. Every turn asks for ``--output-len`` tokens (``ignore_eos``, greedy) as a streaming completion.

Recorded per turn: TTFT, prompt tokens and cached tokens (``usage.prompt_tokens_details.cached_tokens``); the
summary gives, per turn (numbered from 1), the TTFT percentiles over the conversations, the mean prompt and cached
tokens, the cached share of the prompt and the median TTFT against turn 1's; and for turns 2..N together the median
TTFT of all their requests against turn 1's.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import asdict, dataclass

import httpx

from ferrylm.bench.serve import (CLIENT_TIMEOUT, RequestResult, _one, outcome, percentiles, served_model, server_snapshot,
                                 table)


@dataclass
class MultiTurnConfig:
    """Shape of the multi-turn run (all lengths in tokens)."""

    base_url: str
    model: str | None
    num_conversations: int
    num_turns: int
    shared_prefix_len: int
    input_len: int
    output_len: int
    vocab_upper: int = 1000
    seed: int = 0
    api_key: str | None = None


@dataclass
class TurnResult:
    """One turn of one conversation: its request's result, the conversation index (from 0) and the turn number (from
    1)."""

    conversation: int
    turn: int
    result: RequestResult


def _ids(rng: random.Random, n: int, upper: int) -> list[int]:
    return [rng.randrange(1, upper) for _ in range(n)]


async def _conversation(client: httpx.AsyncClient, cfg: MultiTurnConfig, model: str, c: int,
                        system: list[int]) -> list[TurnResult]:
    rng = random.Random(cfg.seed * 1_000_003 + c + 1)
    history = system + _ids(rng, cfg.input_len, cfg.vocab_upper)
    out = []
    for t in range(1, cfg.num_turns + 1):
        res = await _one(client, None, model, history, cfg.output_len, want_ids=True)
        out.append(TurnResult(c, t, res))
        if not res.ok:
            break
        answer = res.token_ids or _ids(rng, cfg.output_len, cfg.vocab_upper)   # a server without token ids
        history = history + answer + _ids(rng, cfg.input_len, cfg.vocab_upper)
    return out


def _ratio(x: float | None, first: float | None) -> float | None:
    return x / first if x is not None and first else None


def _turn_row(t: int, ok: list[RequestResult], first_p50: float | None) -> dict:
    """Turn ``t``'s line of the summary from its successful requests (at least one)."""
    ttft = percentiles([r.ttft for r in ok])
    prompt = sum(r.prompt_tokens for r in ok) / len(ok)
    cached = sum(r.cached_tokens for r in ok) / len(ok)
    return {"turn": t, "completed": len(ok), "ttft_ms": {k: v * 1000 for k, v in ttft.items()},
            "prompt_tokens_mean": prompt, "cached_tokens_mean": cached,
            "cached_fraction": cached / prompt if prompt else 0.0,
            "ttft_p50_vs_turn_1": _ratio(ttft["p50"], first_p50)}


def _later_turns(later: list[RequestResult], first_p50: float | None) -> dict | None:
    """Turns 2..N pooled: the median TTFT (ms) of all their successful requests, its ratio to turn 1's median,
    and their cached share of the prompt tokens; None when there are none."""
    if not later:
        return None
    p50 = percentiles([r.ttft for r in later])["p50"]
    prompt = sum(r.prompt_tokens for r in later)
    return {"completed": len(later), "ttft_ms_p50": p50 * 1000, "ttft_p50_vs_turn_1": _ratio(p50, first_p50),
            "cached_fraction": sum(r.cached_tokens for r in later) / prompt if prompt else 0.0}


def summarize(cfg: MultiTurnConfig, model: str, turns: list[TurnResult], duration: float) -> dict:
    """The run's summary: ``turns`` (per turn number from 1: TTFT ms percentiles, mean prompt and cached tokens,
    cached share, median TTFT against turn 1's, None when turn 1 has no successful request), ``later_turns``
    (:func:`_later_turns`), ``requests`` (every turn of every conversation), totals."""
    ok_at = {t: [x.result for x in turns if x.turn == t and x.result.ok] for t in range(1, cfg.num_turns + 1)}
    first_p50 = percentiles([r.ttft for r in ok_at[1]])["p50"] if ok_at[1] else None
    return {
        "mode": "multi-turn", "model": model, "duration_s": duration, **outcome([x.result for x in turns]),
        "turns": [_turn_row(t, ok, first_p50) for t, ok in ok_at.items() if ok],
        "later_turns": _later_turns([r for t, ok in ok_at.items() if t > 1 for r in ok], first_p50),
        "requests": [{"conversation": x.conversation, "turn": x.turn, "ok": x.result.ok,
                      "ttft_ms": x.result.ttft * 1000, "prompt_tokens": x.result.prompt_tokens,
                      "cached_tokens": x.result.cached_tokens, "output_tokens": x.result.output_tokens}
                     for x in turns],
        "config": asdict(cfg) | {"api_key": None},
    }


async def run_multi_turn(cfg: MultiTurnConfig, transport: httpx.AsyncBaseTransport | None = None) -> dict:
    """Run the conversations (all at once, turns in sequence); return :func:`summarize`'s dict plus ``server``
    (:func:`ferrylm.bench.serve.server_snapshot` before the run). ``transport``: an httpx transport instead of the
    network (tests: the ASGI app in process)."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.num_conversations + 4)
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, timeout=CLIENT_TIMEOUT, limits=limits,
                                 transport=transport) as client:
        model = await served_model(client, cfg.model)
        system = _ids(random.Random(cfg.seed), cfg.shared_prefix_len, cfg.vocab_upper)
        before = await server_snapshot(client)
        t0 = time.perf_counter()
        convs = await asyncio.gather(*(_conversation(client, cfg, model, c, system)
                                       for c in range(cfg.num_conversations)))
        duration = time.perf_counter() - t0
    out = summarize(cfg, model, [x for conv in convs for x in conv], duration)
    out["server"] = {**before["server"], "plan": before["plan"]}
    return out


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def format_multi_turn(s: dict) -> str:
    """Human-readable table of :func:`run_multi_turn`'s summary: one line per turn, then turns 2..N together."""
    c = s["config"]
    lines = [f"model {s['model']}  {c['num_conversations']} conversations x {c['num_turns']} turns  shared prefix "
             f"{c['shared_prefix_len']}  new tokens per turn {c['input_len']}  output {c['output_len']}  "
             f"({s['completed']} ok, {s['duration_s']:.1f} s)",
             "turn  prompt  cached  cached%   TTFT p50 ms   TTFT mean ms   p50 / turn 1"]
    for t in s["turns"]:
        lines.append(f"{t['turn']:>4}  {t['prompt_tokens_mean']:>6.0f}  {t['cached_tokens_mean']:>6.0f}  "
                     f"{100 * t['cached_fraction']:>6.1f}  {t['ttft_ms']['p50']:>12.1f}  {t['ttft_ms']['mean']:>13.1f}"
                     f"  {_num(t['ttft_p50_vs_turn_1'], '.3f'):>12}")
    later = s["later_turns"]
    if later:
        lines.append(f"turns 2..{c['num_turns']}: TTFT p50 {later['ttft_ms_p50']:.1f} ms = "
                     f"{_num(later['ttft_p50_vs_turn_1'], '.3f')} x turn 1, cached "
                     f"{100 * later['cached_fraction']:.1f}% of their prompt tokens")
    return table(lines, s)
