"""``ferry bench serve``: a load generator against a running OpenAI-compatible server.

Sends ``--num-prompts`` streaming completions with ``--concurrency`` in flight, each a random token-id prompt of
``--input-len`` tokens asking for exactly ``--output-len`` tokens (``ignore_eos``), and reports request
throughput (req/s), output throughput (tok/s), time to first token (TTFT) and inter-token latency (ITL)
percentiles — the metrics of vLLM's ``benchmark_serving``. ITL is the gap between consecutive streamed chunks.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

import httpx


@dataclass
class RequestResult:
    """One request: ``ok``; ``ttft`` and ``latency`` in seconds; ``itls`` chunk gaps in seconds;
    ``output_tokens`` and ``cached_tokens`` (prompt tokens served from the server's prefix cache) from the server's
    usage; ``token_ids`` the generated ids when they were asked for (``return_token_ids``)."""

    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""
    cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)


@dataclass
class BenchConfig:
    base_url: str
    model: str | None
    concurrency: int
    num_prompts: int
    input_len: int
    output_len: int
    random_lengths: bool = False
    vocab_upper: int = 1000
    seed: int = 0
    api_key: str | None = None


class BenchError(Exception):
    """The server cannot be benchmarked as asked (a key is needed, no model is served); the message is one line."""


def http_failure(status: int, body: bytes | str) -> str:
    """One line for a refused request: the status, the server's own error message when it sent one (else the
    start of the body as text), and for 401 the flag to pass."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        err = json.loads(text).get("error")
        message = err.get("message") if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        message = None
    line = f"the server answered {status}: {message or text[:200].strip() or '(no body)'}"
    return line + (" (pass --api-key KEY)" if status == 401 else "")


#: a generation may take any time (a long prefill of a model larger than the GPU); a connection may not
CLIENT_TIMEOUT = httpx.Timeout(None, connect=10.0)
MODELS_TIMEOUT_S = 30.0   # the model list, asked first: a server that accepts and never answers fails here


async def served_model(client: httpx.AsyncClient, model: str | None) -> str:
    """``model``, else the first id ``GET /v1/models`` lists. The list is asked either way: it is the run's
    bounded first contact (the requests after it wait as long as generation takes). Raises BenchError when the
    server refuses the list (401 without --api-key), lists none, or does not answer within
    :data:`MODELS_TIMEOUT_S`."""
    try:
        r = await client.get("/v1/models", timeout=MODELS_TIMEOUT_S)
    except httpx.TimeoutException:
        raise BenchError(f"GET /v1/models: no answer within {MODELS_TIMEOUT_S:g} s") from None
    if r.status_code != 200:
        raise BenchError(f"GET /v1/models: {http_failure(r.status_code, r.content)}")
    if model:
        return model
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchError(f"GET /v1/models listed no model: {r.text[:200]}") from None


def percentiles(values: list[float], ps=(50, 90, 99)) -> dict[str, float]:
    """Nearest-rank percentiles (``p50``, ``p90``, ``p99``) and the mean; zeros for an empty list."""
    if not values:
        return {**{f"p{p}": 0.0 for p in ps}, "mean": 0.0}
    s = sorted(values)
    out = {f"p{p}": s[min(len(s) - 1, max(0, int(round(p / 100 * len(s) + 0.5)) - 1))] for p in ps}
    out["mean"] = sum(s) / len(s)
    return out


def outcome(results: list[RequestResult]) -> dict:
    """``completed`` and ``failed`` counts of a run's requests and the first five distinct ``errors`` (sorted)."""
    bad = [r for r in results if not r.ok]
    return {"completed": len(results) - len(bad), "failed": len(bad), "errors": sorted({r.error for r in bad})[:5]}


def table(lines: list[str], summary: dict) -> str:
    """``lines`` as one text, with a ``FAILED`` line last when ``summary`` (:func:`outcome`'s keys) counts
    failures."""
    if summary["failed"]:
        lines = [*lines, f"FAILED {summary['failed']}: {summary['errors']}"]
    return "\n".join(lines)


def make_prompts(cfg: BenchConfig) -> list[tuple[list[int], int]]:
    """``(prompt token ids, max_tokens)`` per request; lengths uniform in [0.5x, 1.5x] with --random-lengths."""
    rng = random.Random(cfg.seed)
    out = []
    for _ in range(cfg.num_prompts):
        il, ol = cfg.input_len, cfg.output_len
        if cfg.random_lengths:
            il = rng.randint(max(1, il // 2), max(1, il * 3 // 2))
            ol = rng.randint(max(1, ol // 2), max(1, ol * 3 // 2))
        out.append(([rng.randrange(1, cfg.vocab_upper) for _ in range(il)], ol))
    return out


async def _one(client: httpx.AsyncClient, cfg: BenchConfig | None, model: str, prompt: list[int], max_tokens: int,
               want_ids: bool = False) -> RequestResult:
    """One streaming completion of ``prompt`` (token ids); ``want_ids``: ask for the generated ids too. (``cfg``
    is not read: the body is the same for every run.)"""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if want_ids:
        body["return_token_ids"] = True
    t0 = time.perf_counter()
    last = None
    res = RequestResult(ok=False)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = http_failure(r.status_code, await r.aread())
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                now = time.perf_counter()
                if chunk.get("choices"):
                    res.token_ids.extend(chunk["choices"][0].get("token_ids") or [])
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itls.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    res.cached_tokens = int(details.get("cached_tokens") or 0)
        res.latency = time.perf_counter() - t0
        res.ok = True
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


_EXPERT_COUNTERS = ("steps", "tokens", "needed", "hits", "misses", "bytes_copied", "bytes_mapped", "cpu_experts")


async def server_snapshot(client: httpx.AsyncClient) -> dict:
    """What the server says about itself: ``server`` (backend, attention backend, dtype, limits, the engine config it
    was started with, from ``GET /v1/memory``), ``plan`` (the memory plan's sizes) and ``experts`` (the expert
    counters of its last heartbeat, ``GET /health``). Missing parts are empty (an older or non-ferrylm server)."""
    out: dict = {"server": {}, "plan": {}, "experts": {}}
    try:
        mem = (await client.get("/v1/memory")).json()
        out["server"] = mem.get("server") or {}
        plan = mem.get("plan") or {}
        out["plan"] = {k: plan.get(k) for k in ("gpu_memory_limit_bytes", "budget_bytes", "weights_bytes",
                                                "workspace_bytes", "graph_bytes", "kv_tokens", "expert_slots",
                                                "expert_total", "max_prefill_length", "prefill_note")}
    except (httpx.HTTPError, ValueError):
        pass
    try:
        eng = ((await client.get("/health")).json().get("engine") or {}).get("experts") or {}
        out["experts"] = {k: eng.get(k, 0) for k in _EXPERT_COUNTERS}
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return out


async def run_bench(cfg: BenchConfig, progress: bool = True) -> dict:
    """Run the benchmark; return the summary dict (see module docstring for the keys; ``server`` is
    :func:`server_snapshot` before the run, ``experts`` the expert counters the server advanced during it, with the
    hit rate and the expert bytes copied per output token)."""
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.concurrency + 4)
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, timeout=CLIENT_TIMEOUT,
                                 limits=limits) as client:
        model = await served_model(client, cfg.model)
        prompts = make_prompts(cfg)
        sem = asyncio.Semaphore(cfg.concurrency)
        bar = tqdm(total=len(prompts), desc=f"bench c={cfg.concurrency}", disable=not progress, unit="req")

        async def guarded(p, m):
            async with sem:
                r = await _one(client, cfg, model, p, m)
                bar.update(1)
                return r

        before = await server_snapshot(client)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(guarded(p, m) for p, m in prompts))
        duration = time.perf_counter() - t0
        bar.close()
        await asyncio.sleep(1.0)  # one heartbeat: the counters of the last steps
        after = await server_snapshot(client)
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    ms = lambda xs: {k: v * 1000 for k, v in percentiles(xs).items()}  # noqa: E731
    return {
        "model": model, "concurrency": cfg.concurrency, "num_prompts": cfg.num_prompts,
        "input_len": cfg.input_len, "output_len": cfg.output_len, "random_lengths": cfg.random_lengths,
        **outcome(results), "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_input_tokens": sum(r.prompt_tokens for r in ok), "total_output_tokens": out_tokens,
        "ttft_ms": ms([r.ttft for r in ok]),
        "itl_ms": ms([x for r in ok for x in r.itls]),
        "e2e_latency_ms": ms([r.latency for r in ok]),
        "config": asdict(cfg) | {"api_key": None},
        "server": {**before["server"], "plan": before["plan"]},
        "experts": _expert_delta(before["experts"], after["experts"], out_tokens),
    }


def _expert_delta(a: dict, b: dict, out_tokens: int) -> dict:
    """Counters advanced between two snapshots, the hit rate, and bytes copied per output token."""
    if not a or not b:
        return {}
    d = {k: b.get(k, 0) - a.get(k, 0) for k in _EXPERT_COUNTERS}
    d["hit_rate"] = d["hits"] / d["needed"] if d["needed"] else 1.0
    d["bytes_copied_per_output_token"] = d["bytes_copied"] / out_tokens if out_tokens else 0.0
    # what crossed PCIe: copies plus the experts the fused kernel read from mapped host memory (offload's table)
    d["pcie_bytes_per_output_token"] = (d["bytes_copied"] + d["bytes_mapped"]) / out_tokens if out_tokens else 0.0
    return d


def format_summary(s: dict) -> str:
    """Human-readable table of :func:`run_bench`'s summary."""
    lines = [
        f"model {s['model']}  concurrency {s['concurrency']}  prompts {s['completed']}/{s['num_prompts']} ok"
        f"  input {s['input_len']}  output {s['output_len']}",
        f"duration            {s['duration_s']:.2f} s",
        f"request throughput  {s['request_throughput']:.3f} req/s",
        f"output throughput   {s['output_throughput']:.1f} tok/s",
    ]
    for key in ("ttft_ms", "itl_ms", "e2e_latency_ms"):
        d = s[key]
        lines.append(f"{key:<19} p50 {d['p50']:.1f}  p90 {d['p90']:.1f}  p99 {d['p99']:.1f}  mean {d['mean']:.1f}")
    srv = s.get("server") or {}
    if srv:
        plan = srv.get("plan") or {}
        lim = plan.get("gpu_memory_limit_bytes")
        lines.append(f"server: {srv.get('moe_backend')} experts, {srv.get('attention_backend')} attention, "
                     f"limit {'none' if lim is None else f'{lim / 2**30:g} GiB'}, chunk {plan.get('max_prefill_length')}"
                     f", KV {plan.get('kv_tokens')} tokens, slots {plan.get('expert_slots')}/{plan.get('expert_total')}")
    ex = s.get("experts") or {}
    if ex.get("needed"):
        lines.append(f"experts: hit rate {100 * ex['hit_rate']:.1f} %, "
                     f"{ex['bytes_copied_per_output_token'] / 1e6:.1f} MB copied, "
                     f"{ex.get('pcie_bytes_per_output_token', 0) / 1e6:.1f} MB over PCIe per output token")
    return table(lines, s)
