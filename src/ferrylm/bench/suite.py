"""``ferry bench suite``: named scenarios, each one ``ferry serve`` (default flags + the scenario's own) measured by
``ferry bench serve`` runs, one JSON per scenario written as soon as it finishes.

Scenarios and run shapes live in ``bench/scenarios.toml``. Each scenario's JSON (``<out-dir>/<date>-<name>.json``,
``kind: "ferry-bench-suite"``) holds the command, the server's recorded config, ``/v1/memory`` before and after,
GPU memory as nvidia-smi reports it, the ready time, and per run the ``bench serve`` summary with its roofline
(``bench/roofline.py``: bytes per output token over HBM, PCIe and host DRAM at the probed bandwidths). The file is
rewritten after every run, so a cut run keeps what finished.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import os
import string
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import httpx

from ferrylm.bench.multi_turn import MultiTurnConfig, run_multi_turn
from ferrylm.bench.report import write_json
from ferrylm.bench.roofline import Bandwidths, decode_roofline, prefill_floor, probe_bandwidths
from ferrylm.bench.serve import BenchConfig, run_bench

SUITE_KIND = "ferry-bench-suite"
SUITE_VERSION = 1


class SuiteError(Exception):
    """A scenario file or selection that cannot run (the message names the scenario or key)."""


@dataclass(frozen=True)
class RunShape:
    """One ``ferry bench serve`` run (lengths in tokens)."""

    name: str
    concurrency: int = 1
    num_prompts: int = 4
    input_len: int = 128
    output_len: int = 128
    multi_turn: bool = False
    num_conversations: int = 4
    num_turns: int = 8
    shared_prefix_len: int = 0


@dataclass(frozen=True)
class Scenario:
    """One served configuration: ``model`` (``${VARS}`` expanded from the environment), the flags after the
    defaults, whether it takes the suite's tokenizer, its runs in order, and the free GPU memory another program
    leaves it (``bench/gpu_hold.py``; None: the GPU is its own)."""

    name: str
    model: str
    args: tuple[str, ...] = ()
    tokenizer: bool = False
    runs: tuple[RunShape, ...] = field(default_factory=tuple)
    hold_leave_gib: float | None = None   # another program holds all but this much GPU memory before the boot


def default_scenarios_path() -> Path:
    return Path(str(resources.files("ferrylm.bench") / "scenarios.toml"))


def load_scenarios(path: Path | None = None) -> list[Scenario]:
    """Parse the scenario file. Raises SuiteError naming a run a scenario lists but the file does not define, or a
    key a run or scenario does not have."""
    data = tomllib.loads((path or default_scenarios_path()).read_text())
    shapes = {}
    for name, body in (data.get("runs") or {}).items():
        try:
            shapes[name] = RunShape(name=name, **body)
        except TypeError as e:
            raise SuiteError(f"run {name!r}: {e}") from None
    out = []
    for sc in data.get("scenario") or []:
        name = sc.get("name", "?")
        unknown = set(sc) - {"name", "model", "args", "tokenizer", "runs", "hold_leave_gib"}
        if unknown:
            raise SuiteError(f"scenario {name!r}: unknown keys {sorted(unknown)}")
        missing = [r for r in sc.get("runs", []) if r not in shapes]
        if missing:
            raise SuiteError(f"scenario {name!r}: runs {missing} are not defined under [runs]")
        out.append(Scenario(name=name, model=sc["model"], args=tuple(sc.get("args", ())),
                            tokenizer=bool(sc.get("tokenizer", False)),
                            runs=tuple(shapes[r] for r in sc.get("runs", ())),
                            hold_leave_gib=sc.get("hold_leave_gib")))
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise SuiteError("scenario names repeat")
    return out


def select(scenarios: list[Scenario], only: str | None) -> list[Scenario]:
    """The scenarios named in the comma list ``only`` in its order (all when None). Raises SuiteError for an
    unknown name, listing the known ones."""
    if not only:
        return scenarios
    by = {s.name: s for s in scenarios}
    picked = []
    for n in (x.strip() for x in only.split(",") if x.strip()):
        if n not in by:
            raise SuiteError(f"unknown scenario {n!r}; scenarios: {', '.join(by)}")
        picked.append(by[n])
    return picked


def serve_command(sc: Scenario, port: int, tokenizer: str | None) -> list[str]:
    """``ferry serve`` for ``sc`` on ``port`` (default flags + the scenario's). Raises SuiteError when the model
    names an unset variable or a synthetic model has no tokenizer."""
    try:
        model = string.Template(sc.model).substitute(os.environ)
    except KeyError as e:
        raise SuiteError(f"scenario {sc.name!r}: set {e.args[0]} in the environment (its model is {sc.model})")
    cmd = [sys.executable, "-m", "ferrylm.cli", "serve", "--model", model, "--port", str(port), *sc.args]
    if sc.tokenizer:
        if not tokenizer:
            raise SuiteError(f"scenario {sc.name!r} serves a synthetic model: pass --tokenizer FOLDER")
        cmd += ["--tokenizer", tokenizer]
    return cmd


def gpu_used_mib() -> int | None:
    """GPU memory in use on device 0 as nvidia-smi reports it (every process), or None without nvidia-smi."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    return int(r.stdout.split()[0]) if r.returncode == 0 and r.stdout.strip() else None


def git_commit() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() or None if r.returncode == 0 else None


class ServerProcess:
    """A ``ferry serve`` child with its log in ``log_path``; :meth:`wait_ready` times the start."""

    def __init__(self, cmd: list[str], port: int, log_path: Path):
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def wait_ready(self, timeout_s: float) -> float | None:
        """Seconds from start to ``/health`` 200, or None (exited or timed out)."""
        while time.monotonic() - self.t0 < timeout_s:
            if self.proc.poll() is not None:
                return None
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - self.t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        return None

    def tail(self, n: int = 20) -> list[str]:
        self._log.flush()
        return self.log_path.read_text(errors="replace").splitlines()[-n:]

    def stop(self, timeout_s: float = 60) -> int | None:
        """SIGTERM (drain), then kill after ``timeout_s``; the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def _memory(base_url: str) -> dict:
    try:
        return httpx.get(base_url + "/v1/memory", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return {}


async def _run_shape(shape: RunShape, base_url: str, vocab_upper: int, seed: int) -> dict:
    if shape.multi_turn:
        cfg = MultiTurnConfig(base_url=base_url, model=None, num_conversations=shape.num_conversations,
                              num_turns=shape.num_turns, shared_prefix_len=shape.shared_prefix_len,
                              input_len=shape.input_len, output_len=shape.output_len, vocab_upper=vocab_upper,
                              seed=seed)
        return await run_multi_turn(cfg)
    cfg = BenchConfig(base_url=base_url, model=None, concurrency=shape.concurrency, num_prompts=shape.num_prompts,
                      input_len=shape.input_len, output_len=shape.output_len, vocab_upper=vocab_upper, seed=seed)
    return await run_bench(cfg, progress=False)


def with_roofline(summary: dict, shape: RunShape, model_bytes: dict, plan: dict, bw: Bandwidths) -> dict:
    """``summary`` plus ``roofline``: the decode roofline of the run's counters and, for a long prompt, the one-pass
    prefill floor; ``achieved`` holds the measured rate beside the floor (1 / ITL p50 at one stream, the output
    throughput above)."""
    if shape.multi_turn:
        return summary
    roof = decode_roofline(summary.get("experts") or {}, model_bytes, summary.get("total_output_tokens", 0), bw)
    itl = (summary.get("itl_ms") or {}).get("p50") or 0.0
    measured = (1000.0 / itl if itl else None) if shape.concurrency == 1 else summary.get("output_throughput")
    roof["measured_tok_s"] = measured
    roof["ratio"] = measured / roof["floor_tok_s"] if measured and roof.get("floor_tok_s") else None
    floor = prefill_floor(plan, model_bytes, bw)
    ttft = (summary.get("ttft_ms") or {}).get("p50") or 0.0
    roof["prefill_floor_s"] = floor
    roof["prefill_ratio"] = floor / (ttft / 1000.0) if floor and ttft else None
    return summary | {"roofline": roof}


def run_scenario(sc: Scenario, *, out_dir: Path, log_dir: Path, date: str, port: int, tokenizer: str | None,
                 bw: Bandwidths, ready_timeout_s: float, vocab_upper: int) -> dict:
    """Serve ``sc``, run its shapes, write and return its JSON record (rewritten after every run)."""
    cmd = serve_command(sc, port, tokenizer)
    path = out_dir / f"{date}-{sc.name}.json"
    rec: dict = {"kind": SUITE_KIND, "version": SUITE_VERSION, "date": date, "scenario": sc.name,
                 "model": sc.model, "args": list(sc.args), "command": cmd[2:], "commit": git_commit(),
                 "machine": {"bandwidths": bw.to_dict(), "gpu_used_mib_before": gpu_used_mib()}, "runs": {}}
    holder = _start_holder(sc.hold_leave_gib, rec) if sc.hold_leave_gib is not None else None
    srv = ServerProcess(cmd, port, log_dir / f"{sc.name}.log")
    try:
        rec["ready_s"] = srv.wait_ready(ready_timeout_s)
        if rec["ready_s"] is None:
            rec["error"] = "not ready"
            rec["log_tail"] = srv.tail()
            return rec
        mem = _memory(srv.base_url)
        rec["memory_before"] = mem
        rec["gpu_used_mib"] = gpu_used_mib()
        info = mem.get("server") or {}
        model_bytes, plan = info.get("model_bytes") or {}, mem.get("plan") or {}
        asyncio.run(_run_shape(RunShape("warmup", num_prompts=1, input_len=16, output_len=8),
                               srv.base_url, vocab_upper, seed=99))
        for i, shape in enumerate(sc.runs):
            summary = asyncio.run(_run_shape(shape, srv.base_url, vocab_upper, seed=i + 1))
            rec["runs"][shape.name] = with_roofline(summary, shape, model_bytes, plan, bw)
            rec["gpu_used_mib_peak"] = max(rec.get("gpu_used_mib_peak") or 0, gpu_used_mib() or 0) or None
            rec["memory_after"] = _memory(srv.base_url)
            write_json(path, rec, sort_keys=True)
    finally:
        rec["exit_code"] = srv.stop()
        if holder is not None:
            holder.kill()
            holder.wait()
        write_json(path, rec, sort_keys=True)
    return rec


def _start_holder(leave_gib: float, rec: dict) -> subprocess.Popen:
    """Start ``bench/gpu_hold.py`` and wait until it holds its memory; note the bytes held in ``rec``."""
    proc = subprocess.Popen([sys.executable, "-m", "ferrylm.bench.gpu_hold", "--leave-gib", str(leave_gib)],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    rec["hold_leave_gib"] = leave_gib
    rec["held_by_other_bytes"] = int(line.split()[1]) if line.startswith("held ") else None
    rec["gpu_used_mib_held"] = gpu_used_mib()
    return proc



def format_record(rec: dict) -> str:
    """One line per run: the scenario, the rate beside its floor, TTFT, hit rate and PCIe bytes per token."""
    lines = [f"{rec['scenario']}: ready {rec.get('ready_s') or 0:.1f} s, GPU {rec.get('gpu_used_mib')} MiB"
             + (f"  ERROR {rec['error']}" if rec.get("error") else "")]
    for name, r in rec.get("runs", {}).items():
        if r.get("mode") == "multi-turn":
            t = r.get("turns") or []
            lines.append(f"  {name}: turn 1 TTFT {t[0]['ttft_ms']['p50']:.0f} ms, later turns "
                         + ", ".join(f"{x['ttft_ms']['p50']:.0f}" for x in t[1:]) if t else f"  {name}: no turns")
            continue
        roof = r.get("roofline") or {}
        ex = r.get("experts") or {}
        floor = roof.get("floor_tok_s")
        lines.append(f"  {name}: {roof.get('measured_tok_s') or 0:.1f} tok/s (floor "
                     f"{'-' if not floor else f'{floor:.1f}'}), ITL p50 {r['itl_ms']['p50']:.1f} ms, TTFT p50 "
                     f"{r['ttft_ms']['p50']:.0f} ms, hit {100 * ex.get('hit_rate', 1.0):.1f} %, PCIe "
                     f"{ex.get('pcie_bytes_per_output_token', 0) / 1e6:.0f} MB/token, failed {r['failed']}")
    return "\n".join(lines)


def main(args) -> int:
    """``ferry bench suite``: 0 when every scenario became ready and every request succeeded, 1 otherwise, 2 for a
    bad selection or scenario file."""
    try:
        scenarios = select(load_scenarios(Path(args.scenarios) if args.scenarios else None), args.only)
        if args.list:
            for s in scenarios:
                print(f"{s.name:<24} {s.model}  {' '.join(s.args) or '(default flags)'}  runs: "
                      f"{', '.join(r.name for r in s.runs)}")
            return 0
        for s in scenarios:
            serve_command(s, args.port, args.tokenizer)   # every scenario's model and tokenizer, before any runs
    except SuiteError as e:
        print(f"ferry bench suite: {e}", file=sys.stderr)
        return 2
    out_dir, log_dir = Path(args.out_dir), Path(args.log_dir or args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    bw = probe_bandwidths()
    print(f"bandwidths: " + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in bw.to_dict().items()
                                       if isinstance(v, float)), flush=True)
    date = args.date or _dt.date.today().isoformat()
    ok = True
    for sc in scenarios:
        rec = run_scenario(sc, out_dir=out_dir, log_dir=log_dir, date=date, port=args.port, tokenizer=args.tokenizer,
                           bw=bw, ready_timeout_s=args.ready_timeout, vocab_upper=args.vocab_upper)
        print(format_record(rec), flush=True)
        ok = ok and not rec.get("error") and all(r.get("failed", 0) == 0 for r in rec["runs"].values())
    return 0 if ok else 1
