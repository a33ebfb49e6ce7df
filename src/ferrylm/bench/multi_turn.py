"""``ferry bench serve --multi-turn``: agent-like conversations against a running server (issue 23).

``--num-conversations`` conversations run at once, each ``--num-turns`` turns in sequence. Every conversation
starts with the same system prefix of ``--shared-prefix-len`` token ids (shared across conversations), then a
user message of ``--input-len`` ids of its own; each later turn re-sends the whole history, the previous answer
(the ids the server generated, asked for with ``return_token_ids``) and a new user message of ``--input-len``
ids. Every turn asks for ``--output-len`` tokens (``ignore_eos``, greedy) as a streaming completion.

Recorded per turn: TTFT, prompt tokens and cached tokens (``usage.prompt_tokens_details.cached_tokens``); the
summary gives, per turn index, the TTFT percentiles over the conversations, the mean cached tokens and their
share of the prompt, and later turns' TTFT against the first turn's.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import asdict, dataclass

import httpx

from ferrylm.bench.serve import RequestResult, _one, percentiles, served_model, server_snapshot


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
    """One turn of one conversation: its request's result and the conversation and turn indices."""

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
    for t in range(cfg.num_turns):
        res = await _one(client, None, model, history, cfg.output_len, want_ids=True)
        out.append(TurnResult(c, t, res))
        if not res.ok:
            break
        answer = res.token_ids or _ids(rng, cfg.output_len, cfg.vocab_upper)   # a server without token ids
        history = history + answer + _ids(rng, cfg.input_len, cfg.vocab_upper)
    return out


def summarize(cfg: MultiTurnConfig, model: str, turns: list[TurnResult], duration: float) -> dict:
    """The run's summary: ``turns`` (per turn index: TTFT ms percentiles, mean prompt and cached tokens, cached
    share, TTFT mean against turn 0's), ``requests`` (every turn of every conversation), totals."""
    per_turn = []
    first_ttft = None
    for t in range(cfg.num_turns):
        ok = [x.result for x in turns if x.turn == t and x.result.ok]
        if not ok:
            continue
        ttft = percentiles([r.ttft for r in ok])
        prompt = sum(r.prompt_tokens for r in ok) / len(ok)
        cached = sum(r.cached_tokens for r in ok) / len(ok)
        if t == 0:
            first_ttft = ttft["mean"]
        per_turn.append({"turn": t, "completed": len(ok), "ttft_ms": {k: v * 1000 for k, v in ttft.items()},
                         "prompt_tokens_mean": prompt, "cached_tokens_mean": cached,
                         "cached_fraction": cached / prompt if prompt else 0.0,
                         "ttft_vs_first_turn": ttft["mean"] / first_ttft if first_ttft else None})
    failed = [x.result for x in turns if not x.result.ok]
    return {
        "mode": "multi-turn", "model": model, "duration_s": duration,
        "completed": sum(1 for x in turns if x.result.ok), "failed": len(failed),
        "errors": sorted({r.error for r in failed})[:5],
        "turns": per_turn,
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
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, timeout=None, limits=limits,
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


def format_multi_turn(s: dict) -> str:
    """Human-readable table of :func:`run_multi_turn`'s summary: one line per turn."""
    c = s["config"]
    lines = [f"model {s['model']}  {c['num_conversations']} conversations x {c['num_turns']} turns  shared prefix "
             f"{c['shared_prefix_len']}  new tokens per turn {c['input_len']}  output {c['output_len']}  "
             f"({s['completed']} ok, {s['duration_s']:.1f} s)",
             "turn  prompt  cached  cached%   TTFT p50 ms   TTFT mean ms   vs turn 0"]
    for t in s["turns"]:
        rel = t["ttft_vs_first_turn"]
        lines.append(f"{t['turn']:>4}  {t['prompt_tokens_mean']:>6.0f}  {t['cached_tokens_mean']:>6.0f}  "
                     f"{100 * t['cached_fraction']:>6.1f}  {t['ttft_ms']['p50']:>12.1f}  {t['ttft_ms']['mean']:>13.1f}"
                     f"  {'' if rel is None else f'{rel:.3f}':>9}")
    if s["failed"]:
        lines.append(f"FAILED {s['failed']}: {s['errors']}")
    return "\n".join(lines)
