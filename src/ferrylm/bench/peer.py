"""``ferry bench peer``: llama.cpp's server and ``ferry serve`` on one GGUF, measured by one client.

1. llama-server: ``--llama-server BINARY``, or built from ``--llama-src`` (a source folder or a tarball of one,
   unpacked under ``--work-dir``) with CMake for the CPU (``GGML_NATIVE``, no CUDA, no curl / OpenSSL, no tests or
   examples), target ``llama-server`` only; the build folder is kept, so a second run only checks it.
2. Rounds: each round starts one engine, waits for ``/health`` 200, sends one warm-up request, runs every shape
   with ``ferry bench serve``'s client (:func:`ferrylm.bench.serve.run_bench`: streamed ``/v1/completions`` of
   token-id prompts with ``ignore_eos``, which llama-server speaks too), stops it, then does the same for the other
   engine; the order alternates between rounds, so drift on a shared host falls on both.
3. One JSON (``kind: "ferry-bench-peer"``): the machine, both commands, every round's summaries, and per shape the
   median over rounds of TTFT p50, ITL p50 and output tok/s for each engine with ``ferry_over_llama`` (for
   throughput above 1 means ferrylm is faster; for TTFT and ITL above 1 means it is slower).

Shapes: ``prefill`` (``--prefill-prompts`` prompts of ``--prefill-len`` tokens, one output token; 0 skips it) and
``c<N>`` per ``--concurrency`` value (``--num-prompts`` prompts of ``--input-len`` tokens, ``--output-len`` out).
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import hashlib
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from ferrylm import __version__
from ferrylm.bench.report import write_json
from ferrylm.bench.serve import BenchConfig, BenchError, run_bench
from ferrylm.bench.suite import RunShape, ServerProcess, git_commit
from ferrylm.cachedir import cache_root
from ferrylm.experts.cpu_pool import physical_cores
from ferrylm.experts.machine_profile import cpu_model_name

KIND = "ferry-bench-peer"
ENGINES = ("llama", "ferry")
CMAKE_FLAGS = ("-DGGML_CUDA=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DCMAKE_BUILD_TYPE=Release")
WARMUP = RunShape("warmup", 1, 1, 16, 4)
METRICS = (("ttft_p50_ms", "ttft_ms"), ("itl_p50_ms", "itl_ms"))


class PeerError(Exception):
    """The comparison cannot run as asked (the message is one line naming the flag or step)."""


@dataclass(frozen=True)
class PeerConfig:
    """Both servers' settings and the shapes (``threads``: llama-server's ``-t``; ``ctx``: its context per slot)."""

    gguf: Path
    shapes: tuple[RunShape, ...]
    rounds: int = 1
    port: int = 8301
    threads: int = 1
    ctx: int = 8192
    vocab_upper: int = 1000
    llama_args: tuple[str, ...] = ()
    ferry_args: tuple[str, ...] = ()
    ready_timeout_s: float = 900.0


# --- llama-server from source ------------------------------------------------------------------------------------
def source_folder(src: Path, work_dir: Path) -> Path:
    """The llama.cpp source folder: ``src`` itself, or a tarball unpacked once under ``work_dir`` (the folder
    holding the top ``CMakeLists.txt``). Raises PeerError for a path that is neither."""
    if src.is_dir():
        if not (src / "CMakeLists.txt").is_file():
            raise PeerError(f"--llama-src {src}: no CMakeLists.txt in it")
        return src
    if not src.is_file() or not tarfile.is_tarfile(src):
        raise PeerError(f"--llama-src {src}: not a source folder or a tarball")
    dest = work_dir / "src" / src.name.split(".tar")[0]
    if not (dest / ".unpacked").is_file():
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        with tarfile.open(src) as tar:
            tar.extractall(dest, filter="data")
        (dest / ".unpacked").write_text(str(src))
    tops = [p.parent for p in (*dest.glob("CMakeLists.txt"), *dest.glob("*/CMakeLists.txt"))]
    if not tops:
        raise PeerError(f"--llama-src {src}: the tarball holds no CMakeLists.txt at its top")
    return tops[0]


def build_llama_server(src: Path, work_dir: Path, jobs: int, log=print) -> tuple[Path, float]:
    """Configure (once) and build llama-server for the CPU; ``(binary, seconds)``. The build log goes to
    ``work_dir/build.log``. Raises PeerError (no cmake, or the build failed: the log's last lines)."""
    cmake = shutil.which("cmake")
    if cmake is None:
        raise PeerError("cmake not found: install it, or pass --llama-server BINARY")
    where = str(src.resolve())
    build = work_dir / f"build-{src.resolve().name}-{hashlib.sha1(where.encode()).hexdigest()[:8]}"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    configured = (build / "CMakeCache.txt").is_file()
    steps = [] if configured else [[cmake, "-S", str(src), "-B", str(build), *gen, *CMAKE_FLAGS]]
    steps.append([cmake, "--build", str(build), "-j", str(jobs), "--target", "llama-server"])
    log_path = work_dir / "build.log"
    t0 = time.monotonic()
    with open(log_path, "a") as f:
        for cmd in steps:
            log(f"running {' '.join(cmd)}  (log: {log_path})")
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode != 0:
                tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
                raise PeerError(f"building llama-server failed ({' '.join(cmd[:3])} ...); {log_path} ends:\n{tail}")
    binary = build / "bin" / "llama-server"
    if not binary.is_file():
        raise PeerError(f"the build finished without {binary}")
    return binary, time.monotonic() - t0


# --- the rounds --------------------------------------------------------------------------------------------------
def slot_context(shapes: tuple[RunShape, ...]) -> int:
    """Tokens one request of the shapes (or the warm-up) may hold, rounded up to 256."""
    longest = max([s.input_len + s.output_len for s in shapes] + [WARMUP.input_len + WARMUP.output_len])
    return -(-longest // 256) * 256


def llama_command(binary: Path, cfg: PeerConfig, port: int) -> list[str]:
    """llama-server with ``-np`` slots for the largest concurrency; its ``-c`` is split among them, so it is
    ``cfg.ctx`` per slot times the slots."""
    parallel = max([s.concurrency for s in cfg.shapes] + [1])
    return [str(binary), "-m", str(cfg.gguf), "--host", "127.0.0.1", "--port", str(port), "-c",
            str(cfg.ctx * parallel), "-np", str(parallel), "-t", str(cfg.threads), *cfg.llama_args]


def ferry_command(cfg: PeerConfig, port: int) -> list[str]:
    """argv of the `ferry serve` side: the GGUF, ``port``, then the user's extra flags."""
    return [sys.executable, "-m", "ferrylm.cli", "serve", "--model", str(cfg.gguf), "--port", str(port),
            *cfg.ferry_args]


def round_order(rounds: int) -> list[tuple[int, str]]:
    """``(round, engine)`` in run order: llama first in even rounds, ferry first in odd ones."""
    return [(r, e) for r in range(rounds) for e in (ENGINES if r % 2 == 0 else ENGINES[::-1])]


def _check_port_free(port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # a closed server's TIME_WAIT is no owner
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise PeerError(f"port {port} is in use (--port): stop what runs there or pick another") from None


def run_engine(engine: str, cmd: list[str], port: int, cfg: PeerConfig, log_path: Path, log=print) -> dict:
    """Serve with ``cmd``, run the warm-up and every shape; the round's record (``error`` when it never became
    ready)."""
    _check_port_free(port)
    base = f"http://127.0.0.1:{port}"
    rec: dict = {"engine": engine, "command": cmd, "runs": {}}
    srv = ServerProcess(cmd, port, log_path)
    try:
        rec["ready_s"] = srv.wait_ready(cfg.ready_timeout_s)
        if rec["ready_s"] is None:
            rec["error"] = "not ready (exited or timed out)"
            rec["log_tail"] = srv.tail()
            return rec
        log(f"{engine}: ready in {rec['ready_s']:.1f} s")
        _run_shapes(engine, base, cfg, rec["runs"], log)
    except (BenchError, httpx.HTTPError) as e:   # the server misbehaved: this round's record says how
        rec["error"] = f"{type(e).__name__}: {e}"
        rec["log_tail"] = srv.tail()
    finally:
        rec["exit_code"] = srv.stop()
    return rec


def _run_shapes(engine: str, base: str, cfg: PeerConfig, runs: dict, log) -> None:
    """One warm-up request, then every shape's ``bench serve`` summary into ``runs``."""
    asyncio.run(run_bench(_bench_config(base, WARMUP, cfg.vocab_upper, 99), progress=False))
    for i, shape in enumerate(cfg.shapes):
        s = asyncio.run(run_bench(_bench_config(base, shape, cfg.vocab_upper, i + 1), progress=False))
        runs[shape.name] = s
        log(f"{engine} {shape.name}: TTFT p50 {s['ttft_ms']['p50']:.0f} ms, ITL p50 {s['itl_ms']['p50']:.1f} ms, "
            f"{s['output_throughput']:.2f} tok/s, failed {s['failed']}")


def _bench_config(base: str, shape: RunShape, vocab_upper: int, seed: int) -> BenchConfig:
    return BenchConfig(base_url=base, model=None, concurrency=shape.concurrency, num_prompts=shape.num_prompts,
                       input_len=shape.input_len, output_len=shape.output_len, vocab_upper=vocab_upper, seed=seed)


def summarize(rounds: list[dict], shapes: tuple[RunShape, ...]) -> dict:
    """Per shape and engine the median over rounds of TTFT p50, ITL p50 (ms) and output tok/s, and
    ``ferry_over_llama`` for each; ``ready_s`` likewise."""
    def med(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    out: dict = {}
    for shape in shapes:
        row: dict = {}
        for engine in ENGINES:
            runs = [r["runs"][shape.name] for r in rounds if r["engine"] == engine and shape.name in r["runs"]]
            row[engine] = {k: med([s[src]["p50"] for s in runs]) for k, src in METRICS}
            row[engine]["output_tok_s"] = med([s["output_throughput"] for s in runs])
            row[engine]["failed"] = sum(s["failed"] for s in runs)
        row["ferry_over_llama"] = {k: ratio(row["ferry"][k], row["llama"][k])
                                   for k in ("ttft_p50_ms", "itl_p50_ms", "output_tok_s")}
        out[shape.name] = row
    ready = {e: med([r["ready_s"] for r in rounds if r["engine"] == e and r.get("ready_s")]) for e in ENGINES}
    out["ready_s"] = ready | {"ferry_over_llama": ratio(ready["ferry"], ready["llama"])}
    return out


def format_summary(summary: dict, shapes: tuple[RunShape, ...]) -> str:
    """The side-by-side table: per shape TTFT p50, ITL p50 and tok/s of both engines and ferry / llama."""
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    lines = [f"{'shape':<10} {'metric':<12} {'llama.cpp':>10} {'ferrylm':>10} {'ferry/llama':>11}"]
    for shape in shapes:
        row = summary[shape.name]
        keys = (("ttft_p50_ms", ".0f"), ("itl_p50_ms", ".1f"), ("output_tok_s", ".2f"))
        for key, fmt in keys[:1] if shape.output_len == 1 else keys:   # one output token: only its TTFT
            lines.append(f"{shape.name:<10} {key:<12} {f(row['llama'][key], fmt):>10} {f(row['ferry'][key], fmt):>10} "
                         f"{f(row['ferry_over_llama'][key], '.2f'):>11}")
    r = summary["ready_s"]
    lines.append(f"{'start':<10} {'ready_s':<12} {f(r['llama'], '.1f'):>10} {f(r['ferry'], '.1f'):>10} "
                 f"{f(r['ferry_over_llama'], '.2f'):>11}")
    return "\n".join(lines)


def run_peer(cfg: PeerConfig, binary: Path, out_path: Path, log_dir: Path, llama_info: dict, log=print) -> dict:
    """Every round of :func:`round_order`; the JSON record (rewritten after each round, so a cut run keeps what
    finished)."""
    rec: dict = {"kind": KIND, "version": 1, "date": _dt.date.today().isoformat(), "gguf": str(cfg.gguf),
                 "gguf_bytes": cfg.gguf.stat().st_size,
                 "machine": {"cpu": cpu_model_name(), "cores": physical_cores(), "llama_threads": cfg.threads},
                 "ferrylm": {"version": __version__, "commit": git_commit(), "command": ferry_command(cfg, cfg.port + 1)},
                 "llama": llama_info | {"command": llama_command(binary, cfg, cfg.port)},
                 "shapes": [asdict(s) for s in cfg.shapes], "rounds": []}
    log_dir.mkdir(parents=True, exist_ok=True)
    for r, engine in round_order(cfg.rounds):
        port = cfg.port if engine == "llama" else cfg.port + 1
        cmd = llama_command(binary, cfg, port) if engine == "llama" else ferry_command(cfg, port)
        log(f"round {r + 1}/{cfg.rounds}: {engine}: {' '.join(cmd)}")
        rec["rounds"].append({"round": r} | run_engine(engine, cmd, port, cfg, log_dir / f"{engine}-{r}.log", log))
        rec["summary"] = summarize(rec["rounds"], cfg.shapes)
        write_json(out_path, rec)
    return rec


# --- the command -------------------------------------------------------------------------------------------------
def shapes_from_args(args) -> tuple[RunShape, ...]:
    """The shapes of the module docstring. Raises PeerError naming a flag out of range."""
    for flag, v in (("--num-prompts", args.num_prompts), ("--input-len", args.input_len),
                    ("--output-len", args.output_len), ("--rounds", args.rounds)):
        if v < 1:
            raise PeerError(f"{flag} must be >= 1, got {v}")
    if args.prefill_len < 0 or args.prefill_prompts < 1:
        raise PeerError("--prefill-len must be >= 0 and --prefill-prompts >= 1")
    try:
        conc = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        conc = []
    if not conc or min(conc) < 1:
        raise PeerError(f"--concurrency takes a comma list of integers >= 1, got {args.concurrency!r}")
    shapes = [RunShape("prefill", 1, args.prefill_prompts, args.prefill_len, 1)] if args.prefill_len else []
    return tuple(shapes + [RunShape(f"c{c}", c, args.num_prompts, args.input_len, args.output_len) for c in conc])


def gguf_vocab(path: Path) -> int:
    """Tokens in the GGUF's vocabulary (its header). Raises PeerError for a file that is not a GGUF."""
    from ferrylm.checkpoints.gguf_reader import read_gguf

    try:
        n = len(read_gguf(path).get("tokenizer.ggml.tokens") or ())
    except Exception as e:  # noqa: BLE001 - any unreadable header is the same mistake
        raise PeerError(f"--gguf {path}: not a readable GGUF ({type(e).__name__}: {e})") from None
    if n < 2:
        raise PeerError(f"--gguf {path}: its header lists no vocabulary (tokenizer.ggml.tokens)")
    return n


def llama_server(args, log) -> tuple[Path, dict]:
    """The llama-server binary (given, or built from ``--llama-src``) and what the JSON records of it."""
    if args.llama_server:
        binary = Path(args.llama_server)
        if not binary.is_file():
            raise PeerError(f"--llama-server {binary}: no such file")
        info = {"source": None, "build_s": None}
    else:
        work = Path(args.work_dir) if args.work_dir else cache_root() / "peer"
        work.mkdir(parents=True, exist_ok=True)
        src = source_folder(Path(args.llama_src), work)
        binary, secs = build_llama_server(src, work, args.build_jobs, log)
        info = {"source": str(args.llama_src), "build_s": round(secs, 1)}
    try:
        r = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
        info["version"] = (r.stdout + r.stderr).strip()[-400:]
    except (OSError, subprocess.SubprocessError) as e:
        raise PeerError(f"cannot run {binary} ({e})") from None
    return binary, info | {"binary": str(binary)}


def main(args) -> int:
    """``ferry bench peer``: 0 when both engines answered every request, 1 when one failed, 2 for a bad flag or a
    failed build."""
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    try:
        if bool(args.llama_src) == bool(args.llama_server):
            raise PeerError("pass one of --llama-src PATH_OR_TARBALL (build) and --llama-server BINARY")
        if args.ctx is not None and args.ctx < 1:
            raise PeerError(f"--ctx must be >= 1, got {args.ctx}")
        if not args.build_only:
            if not args.gguf or not Path(args.gguf).is_file():
                raise PeerError(f"--gguf {args.gguf}: no such file")
            shapes, vocab = shapes_from_args(args), gguf_vocab(Path(args.gguf))
        binary, info = llama_server(args, log)
    except PeerError as e:
        print(f"ferry bench peer: {e}", file=sys.stderr)
        return 2
    if args.build_only:
        print(f"llama-server: {binary} ({info.get('build_s')} s)")
        return 0
    cfg = PeerConfig(gguf=Path(args.gguf).resolve(), shapes=shapes, rounds=args.rounds, port=args.port,
                     threads=args.threads or physical_cores(), ctx=args.ctx or slot_context(shapes),
                     vocab_upper=min(args.vocab_upper or 1000, vocab), llama_args=tuple(shlex.split(args.llama_args)),
                     ferry_args=tuple(shlex.split(args.ferry_args)), ready_timeout_s=args.ready_timeout)
    out = Path(args.output_json or f"peer-{_dt.date.today().isoformat()}.json")
    try:
        rec = run_peer(cfg, binary, out, Path(args.log_dir) if args.log_dir else out.parent, info, log)
    except PeerError as e:
        print(f"ferry bench peer: {e}", file=sys.stderr)
        return 2
    print(format_summary(rec["summary"], cfg.shapes))
    print(f"written: {out}")
    bad = [r for r in rec["rounds"] if r.get("error") or any(s["failed"] for s in r["runs"].values())]
    return 1 if bad else 0
