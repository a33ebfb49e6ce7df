"""``ferry bench ...``: the benchmarks' command lines and their hand-off to ``ferrylm/bench``'s modules (each
imported when its command runs)."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from ferrylm.bench.report import add_output_flag, check_outputs, report
from ferrylm.config import CPU_KERNELS
from ferrylm.flags import add_log_level
from ferrylm.registry import Registry

#: ``ferry bench`` commands that hand their namespace to a module's ``main(args) -> int``
BENCH_MAINS: Registry[Callable[[argparse.Namespace], int]] = Registry("ferry bench", {
    "decode": "ferrylm.bench.decode:main",
    "suite": "ferrylm.bench.suite:main",
    "tables": "ferrylm.bench.tables:main",
    "cpu-experts": "ferrylm.bench.cpu_experts:main",
    "kernels": "ferrylm.bench.kernels:main",
    "cache-policy": "ferrylm.bench.cache_policy:main",
    "accelerate": "ferrylm.bench.accelerate_offload:main",
    "bw": "ferrylm.bench.bw:main",
    "peer": "ferrylm.bench.peer:main",
})


def add_bench_parser(sub: argparse._SubParsersAction, *, model_args: Callable[..., None],
                     port: Callable[[str], int], default_model: str) -> None:
    """Add ``ferry bench`` and its commands to ``sub``.

    Args:
        model_args: adds the serve model flags to a parser (``ferry bench decode`` takes them), with the keywords of
            :func:`ferrylm.flags.add_flags`.
        port: the argparse type of ``--port``.
        default_model: ``--model``'s default for ``ferry bench hf``.
    """
    b = sub.add_parser("bench", help="benchmarks")
    b.set_defaults(usage_parser=b)
    bsub = b.add_subparsers(dest="bench_command", metavar="COMMAND")   # required: ferrylm.cli.parse_args says so
    _add_serve(bsub, port)
    _add_suite(bsub, port)
    _add_decode(bsub, model_args)
    _add_cpu_experts(bsub)
    _add_bw(bsub)
    _add_peer(bsub, port)
    _add_kernels_and_cache_policy(bsub)
    _add_baselines(bsub, default_model)
    for p in bsub.choices.values():   # errors (an unknown option) print the bench command's own usage line
        p.set_defaults(usage_parser=p)


BENCH_HOST, BENCH_PORT = "127.0.0.1", 8000   # ferry bench serve's server, unless --base-url names one


def _add_serve(bsub: argparse._SubParsersAction, port_number: Callable[[str], int]) -> None:
    bs = bsub.add_parser("serve", help="load generator against a running server (TTFT, ITL, throughput)",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    bs.add_argument("--host", default=BENCH_HOST, help="server address")
    bs.add_argument("--port", type=port_number, default=BENCH_PORT, help="server port")
    bs.add_argument("--base-url", default=None,
                    help="the server's URL (http[s]://HOST[:PORT][/PREFIX]), instead of --host and --port; a "
                         "trailing /v1 is dropped (the client adds it)")
    bs.add_argument("--model", default=None, help="model id; None: the server's first model")
    bs.add_argument("--concurrency", type=int, default=1, help="requests in flight")
    bs.add_argument("--num-prompts", type=int, default=32, help="requests sent in all")
    bs.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    bs.add_argument("--output-len", type=int, default=64, help="generated tokens per request (ignore_eos)")
    bs.add_argument("--random-lengths", action="store_true", help="lengths uniform in [0.5x, 1.5x]")
    bs.add_argument("--vocab-upper", type=int, default=1000, help="prompt token ids are drawn from [1, N)")
    bs.add_argument("--seed", type=int, default=0, help="seed of the prompts and lengths")
    bs.add_argument("--api-key", default=None, help="bearer key of the server (the server's --api-key)")
    add_output_flag(bs, "--output-json", help="write the summary here")
    bs.add_argument("--multi-turn", action="store_true",
                    help="agent-like conversations: each turn re-sends the history, the previous answer and "
                         "--input-len new tokens after a system prefix shared by every conversation; reports TTFT "
                         "and cached tokens per turn")
    bs.add_argument("--num-conversations", type=int, default=4, help="--multi-turn: conversations at once")
    bs.add_argument("--num-turns", type=int, default=8, help="--multi-turn: turns per conversation")
    bs.add_argument("--shared-prefix-len", type=int, default=2048,
                    help="--multi-turn: tokens of the system prefix every conversation starts with")
    add_log_level(bs, "WARNING")


def _add_suite(bsub: argparse._SubParsersAction, port_number: Callable[[str], int]) -> None:
    bu = bsub.add_parser("suite", help="named scenarios: each one `ferry serve` (default flags + its own) measured "
                                        "by `ferry bench serve`, one JSON per scenario with its roofline")
    bu.add_argument("--only", default=None, help="comma list of scenario names (default: all; --list shows them)")
    bu.add_argument("--list", action="store_true", help="print the scenarios and exit")
    bu.add_argument("--scenarios", default=None, help="scenario file (default: the package's bench/scenarios.toml)")
    bu.add_argument("--tokenizer", default=None, help="tokenizer folder for the synthetic models' scenarios")
    add_output_flag(bu, "--out-dir", default="docs/bench", folder=True,
                    help="where the JSON goes (default: docs/bench)")
    add_output_flag(bu, "--log-dir", folder=True, help="where the servers' logs go (default: --out-dir)")
    bu.add_argument("--date", default=None, help="date prefix of the JSON names (default: today)")
    bu.add_argument("--port", type=port_number, default=8391, help="port of the servers (default: 8391)")
    bu.add_argument("--ready-timeout", type=float, default=600.0,
                    help="seconds a server may take to become ready (default: 600)")
    bu.add_argument("--vocab-upper", type=int, default=1000, help="prompt token ids from [1, N) (default: 1000)")
    add_log_level(bu, "WARNING")

    bt = bsub.add_parser("tables", help="write the headline tables of BENCHMARKS.md from the suite's JSON")
    bt.add_argument("--bench-dir", default="docs/bench", help="the JSON folder (default: docs/bench)")
    bt.add_argument("--doc", default="docs/BENCHMARKS.md", help="the document (default: docs/BENCHMARKS.md)")
    bt.add_argument("--check", action="store_true", help="exit 1 when the document differs from the JSON's tables")
    add_log_level(bt, "WARNING")


def _add_decode(bsub: argparse._SubParsersAction, model_args: Callable[..., None]) -> None:
    bd = bsub.add_parser("decode", help="decode speed of the MoE backends: tok/s, hit rate, PCIe bytes/token, "
                                        "measured bandwidths, roofline")
    # NOTE: auto is decided by `ferry serve`; the bench compares backends
    model_args(bd, defaults={"moe_backend": "all"},
               extra_choices={"moe_backend": {"all": "every backend side by side"}})
    bd.add_argument("--batch", default="1", help="sequences decoded together; a comma list runs each size over the "
                                                 "same loaded model, e.g. 1,16,64 (default: 1)")
    bd.add_argument("--tokens", type=int, default=128, help="decode tokens per sequence (default: 128)")
    bd.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per sequence (default: 16)")
    bd.add_argument("--no-prefetch", action="store_true", help="offload: no next-layer prefetch")
    bd.add_argument("--temperature", type=float, default=0.0,
                    help="0 = greedy (default); > 0 samples, seeded per request (varied routing on synthetic models)")
    add_output_flag(bd, "--output-json", help="write the results here")
    bd.add_argument("--profile-steps", type=int, default=0,
                    help="after each backend's run, decode N more tokens under torch.profiler and print the "
                         "top ops by host and device time (default: 0 = off)")


def _add_cpu_experts(bsub: argparse._SubParsersAction) -> None:
    bc = bsub.add_parser("cpu-experts", help="CPU expert jobs (one token per expert, as at decode) timed per "
                                             "kernel, threads and experts per job")
    bc.add_argument("--hidden", type=int, default=2048, help="hidden size H (default: 2048, Qwen3-30B-A3B)")
    bc.add_argument("--inter", type=int, default=768, help="expert intermediate size I (default: 768)")
    bc.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="expert weight dtype (default: bfloat16)")
    bc.add_argument("--quant", default="none",
                    help="comma list of expert formats: none (plain --dtype rows) and the synthetic quant names "
                         "fp8, int4, mxfp4, nvfp4 (random codes of that format; default: none)")
    bc.add_argument("--kernels", default="torch,native", help="comma list of --moe-cpu-kernel values "
                                                                "(default: torch,native)")
    bc.add_argument("--threads", default=None, help="comma list of thread counts (default: physical cores)")
    bc.add_argument("--experts", default="1,2,4", help="comma list of experts per job (default: 1,2,4)")
    bc.add_argument("--jobs", type=int, default=100, help="timed jobs per configuration (default: 100)")
    bc.add_argument("--gap-ms", type=float, default=0.5,
                    help="calling thread busy between jobs, as between layers (default: 0.5)")
    bc.add_argument("--dma", default="auto", choices=["auto", "on", "off"],
                    help="pinned host->device copies during the jobs, as the prefetch does (default: auto = on "
                         "with CUDA)")
    bc.add_argument("--bank-experts", type=int, default=64,
                    help="distinct experts the jobs cycle through, beyond the CPU caches (default: 64)")
    add_output_flag(bc, "--output-json", help="write the rows here")
    add_log_level(bc, "WARNING")


def _add_bw(bsub: argparse._SubParsersAction) -> None:
    bw = bsub.add_parser("bw", help="this machine's copy rates and the CPU expert kernel per format and thread "
                                    "count, alone and beside host->device copies: a table, the verdict (backend, "
                                    "CPU threads), and the machine profile `ferry serve` starts from")
    bw.add_argument("--device", default="auto", help="auto | cuda[:N] | cpu (default: auto)")
    bw.add_argument("--formats", default=None, help="comma list of expert formats: bf16, f32 and the synthetic "
                                                    "quant names (fp8, int4, q4_k, ...; default: all)")
    bw.add_argument("--threads", default=None, help="comma list of CPU thread counts (default: 1, 2, 4, ... and the "
                                                    "physical cores)")
    bw.add_argument("--hidden", type=int, default=2048, help="expert hidden size H (default: 2048)")
    bw.add_argument("--inter", type=int, default=768, help="expert intermediate size I (default: 768)")
    bw.add_argument("--experts-per-job", type=int, default=8, help="experts per CPU job, one token each (default: 8)")
    bw.add_argument("--jobs", type=int, default=20, help="timed CPU jobs per measurement (median; default: 20)")
    bw.add_argument("--reps", type=int, default=5, help="timed copies per copy probe (best; default: 5)")
    bw.add_argument("--bank-mib", type=float, default=512, help="expert rows the jobs walk through (default: 512)")
    bw.add_argument("--copy-mib", type=float, default=256, help="copy probe size (default: 256)")
    bw.add_argument("--host-mib", type=float, default=1024, help="host read probe size (default: 1024)")
    bw.add_argument("--kernel", default="auto", choices=CPU_KERNELS, help="--moe-cpu-kernel (default: auto)")
    add_output_flag(bw, "--output-json", help="write the profile here too")
    bw.add_argument("--no-save", action="store_true", help="do not write the machine profile into the cache")
    add_log_level(bw, "WARNING")


def _add_peer(bsub: argparse._SubParsersAction, port_number: Callable[[str], int]) -> None:
    pe = bsub.add_parser("peer", help="llama.cpp's server (built for the CPU from a source you name, or given) and "
                                      "`ferry serve` on one GGUF, alternately, measured by the `bench serve` client: "
                                      "one JSON with both sides and their ratio")
    pe.add_argument("--gguf", default=None, help="the GGUF both engines serve")
    pe.add_argument("--llama-src", default=None, metavar="PATH_OR_TARBALL", help="llama.cpp source to build")
    pe.add_argument("--llama-server", default=None, metavar="BINARY", help="an existing llama-server instead")
    pe.add_argument("--work-dir", default=None, help="where sources unpack and build (default: <cache>/peer)")
    pe.add_argument("--build-jobs", type=int, default=2, help="parallel build jobs (default: 2)")
    pe.add_argument("--build-only", action="store_true", help="build llama-server, print its path, exit")
    pe.add_argument("--rounds", type=int, default=2, help="rounds; each runs both engines (default: 2)")
    pe.add_argument("--port", type=port_number, default=8301, help="llama-server's port; ferry serve's is the next "
                                                                    "(default: 8301)")
    pe.add_argument("--threads", type=int, default=None, help="llama-server -t (default: physical cores)")
    pe.add_argument("--ctx", type=int, default=None, help="llama-server's context per slot (its -c is this x -np, "
                                                          "the largest --concurrency; default: the longest shape, "
                                                          "rounded up to 256)")
    pe.add_argument("--llama-args", default="", help="more llama-server flags, one string")
    pe.add_argument("--ferry-args", default="", help="more ferry serve flags, one string")
    pe.add_argument("--prefill-len", type=int, default=1024, help="prefill shape's prompt tokens (0: no such shape; "
                                                                  "default: 1024)")
    pe.add_argument("--prefill-prompts", type=int, default=2, help="prefill shape's prompts (default: 2)")
    pe.add_argument("--concurrency", default="1,4", help="decode shapes' concurrency, comma list (default: 1,4)")
    pe.add_argument("--num-prompts", type=int, default=8, help="prompts per decode shape (default: 8)")
    pe.add_argument("--input-len", type=int, default=128, help="decode shapes' prompt tokens (default: 128)")
    pe.add_argument("--output-len", type=int, default=32, help="decode shapes' output tokens (default: 32)")
    pe.add_argument("--vocab-upper", type=int, default=None, help="prompt ids from [1, N) (default: the GGUF's "
                                                                  "vocabulary, at most 1000)")
    pe.add_argument("--ready-timeout", type=float, default=900.0, help="seconds a server may take to become ready "
                                                                      "(default: 900)")
    add_output_flag(pe, "--output-json", help="the JSON (default: peer-<date>.json)")
    add_output_flag(pe, "--log-dir", folder=True, help="the servers' logs (default: beside the JSON)")
    add_log_level(pe, "WARNING")


def _add_kernels_and_cache_policy(bsub: argparse._SubParsersAction) -> None:
    bk = bsub.add_parser("kernels", help="GPU kernel candidates side by side: paged attention (Triton vs torch), "
                                         "fused MoE (Triton vs torch._grouped_mm vs the torch path)")
    add_output_flag(bk, "--output-json", help="write the rows here")
    bk.add_argument("--only", default=None, help="comma list of groups: attention, moe, mapped (the offload table "
                                                 "launch reading experts from slots or mapped host memory); "
                                                 "default all")
    add_log_level(bk, "WARNING")

    bp = bsub.add_parser("cache-policy", help="expert-cache hit rate vs slots per layer by policy, and next-layer "
                                              "prefetch, simulated on synthetic routing traces (CPU, no model)")
    bp.add_argument("--profiles", default="qwen3,olmoe,wide512,uniform",
                    help="routing profiles, comma-separated (default: qwen3,olmoe,wide512,uniform)")
    bp.add_argument("--batches", default="1,8", help="sequences decoded together, comma-separated (default: 1,8)")
    bp.add_argument("--policies", default="lru,layer-lru,layer-lfu,layer-lrfu-q0.5,layer-lrfu,layer-lrfu-q2,"
                                          "layer-lrfu-q4,opt",
                    help="policies, comma-separated (see ferrylm/bench/cache_policy.py)")
    bp.add_argument("--layers", type=int, default=8, help="MoE layers simulated (default: 8)")
    bp.add_argument("--steps", type=int, default=384, help="decode steps, the first 64 warm-up (default: 384)")
    bp.add_argument("--seed", type=int, default=0, help="seed of the routing traces (default: 0)")
    add_output_flag(bp, "--json", help="write every curve and the prefetch figures here")
    bp.add_argument("--verbose", action="store_true", help="one line per simulation on stderr")
    add_log_level(bp, "WARNING")



def _add_baselines(bsub: argparse._SubParsersAction, default_model: str) -> None:
    bh = bsub.add_parser("hf", help="the bench-serve prompts through transformers generate (reference speed)")
    bh.add_argument("--model", default=default_model, help=f"built-in name or HF folder (default: {default_model})")
    bh.add_argument("--batch", type=int, default=1, help="sequences generated together (default: 1)")
    bh.add_argument("--num-prompts", type=int, default=32, help="prompts in all (default: 32)")
    bh.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: 128)")
    bh.add_argument("--output-len", type=int, default=64, help="generated tokens per prompt (default: 64)")
    bh.add_argument("--vocab-upper", type=int, default=1000, help="prompt token ids are drawn from [1, N) "
                                                                  "(default: 1000)")
    bh.add_argument("--seed", type=int, default=0, help="prompt seed (default: 0)")
    bh.add_argument("--dtype", default="float32", help="model dtype (default: float32)")
    add_log_level(bh, "WARNING")

    ba = bsub.add_parser("accelerate", help="baseline: the same synthetic model and GPU cap through transformers + "
                                            "accelerate offload (device_map with max_memory), greedy decode tok/s "
                                            "(needs pip install 'ferrylm[bench]')")
    ba.add_argument("--model", required=True, metavar="SPEC", help="synthetic:<preset>[:layers=N][:seed=S]")
    ba.add_argument("--gpu-memory-limit", type=float, default=None, metavar="GiB",
                    help="device memory the baseline may use, in GiB: accelerate gets it less --reserve for "
                         "weights, the caching allocator is capped at it (default: no cap, nothing offloaded)")
    ba.add_argument("--reserve", type=float, default=1.0, metavar="GiB",
                    help="part of --gpu-memory-limit kept out of accelerate's weight budget for the KV cache and "
                         "activations (default: 1)")
    ba.add_argument("--cpu-memory-limit", type=float, default=None, metavar="GiB",
                    help="host memory accelerate may place weights in (default: unbounded)")
    ba.add_argument("--batch", type=int, default=1, help="sequences decoded together (default: 1)")
    ba.add_argument("--tokens", type=int, default=32, help="timed decode steps after the prefill (default: 32)")
    ba.add_argument("--prompt-tokens", "--prompt-len", dest="prompt_tokens", type=int, default=16,
                    help="prompt tokens per sequence (default: 16)")
    ba.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="model dtype (default: bfloat16)")
    ba.add_argument("--device", default="auto", help="auto | cuda[:N] | cpu (default: auto)")
    ba.add_argument("--seed", type=int, default=0, help="prompt seed, as ferry bench decode --seed (default: 0)")
    add_output_flag(ba, "--output-json", help="write the result (with the token ids) here")
    add_log_level(ba, "WARNING")


def run(args: argparse.Namespace) -> int:
    """Run the ``ferry bench`` command ``args`` names; its exit status (2, before any work, when one of its output
    paths cannot be written)."""
    problem = check_outputs(args)
    if problem:
        print(f"ferry bench {args.bench_command}: {problem}", file=sys.stderr)
        return 2
    if args.bench_command in BENCH_MAINS:
        return BENCH_MAINS.get(args.bench_command)(args)
    if args.bench_command == "hf":
        return _hf(args)
    if args.multi_turn:
        return _bench_multi_turn(args)
    return _bench_serve(args)


def _hf(args: argparse.Namespace) -> int:
    from ferrylm.bench.hf_baseline import run_hf_baseline
    from ferrylm.bench.serve import BenchConfig
    from ferrylm.checkpoints.resolve import resolve_model

    cfg = BenchConfig(base_url="", model=None, concurrency=args.batch, num_prompts=args.num_prompts,
                      input_len=args.input_len, output_len=args.output_len, vocab_upper=args.vocab_upper,
                      seed=args.seed)
    res = run_hf_baseline(str(resolve_model(args.model).path), cfg, args.batch, args.dtype)
    print(f"transformers generate  batch {res['batch']}  prompts {res['num_prompts']}  "
          f"output throughput {res['output_throughput']:.1f} tok/s  ({res['duration_s']:.1f} s)")
    return 0


def server_url(args: argparse.Namespace) -> str | None:
    """The server's base URL from ``--base-url`` (its trailing ``/`` and ``/v1`` dropped), else ``--host`` and
    ``--port``; None (after a line naming the flag) when ``--base-url`` is not an http(s) URL with a host."""
    import httpx

    if args.base_url is None:
        host = f"[{args.host}]" if ":" in args.host and not args.host.startswith("[") else args.host
        return f"http://{host}:{args.port}"
    try:
        url = httpx.URL(args.base_url)
    except (httpx.InvalidURL, TypeError, ValueError):
        url = None
    if url is None or url.scheme not in ("http", "https") or not url.host or \
            (url.port is not None and not 1 <= url.port <= 65535):
        print(f"ferry bench serve: --base-url must be an http:// or https:// URL with a host (and a port in "
              f"1-65535), got {args.base_url!r}", file=sys.stderr)
        return None
    if (args.host, args.port) != (BENCH_HOST, BENCH_PORT):
        print("ferry bench serve: give --base-url or --host / --port, not both", file=sys.stderr)
        return None
    base = str(url.copy_with(query=None, fragment=None)).rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


def _bench_serve(args: argparse.Namespace) -> int:
    from ferrylm.bench.serve import BenchConfig, format_summary, run_bench

    for flag, v in (("--concurrency", args.concurrency), ("--num-prompts", args.num_prompts),
                    ("--input-len", args.input_len), ("--output-len", args.output_len)):
        if v < 1:
            print(f"ferry bench serve: {flag} must be >= 1", file=sys.stderr)
            return 2
    base_url = server_url(args)
    if base_url is None:
        return 2
    cfg = BenchConfig(base_url=base_url, model=args.model, concurrency=args.concurrency,
                      num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                      random_lengths=args.random_lengths, vocab_upper=args.vocab_upper, seed=args.seed,
                      api_key=args.api_key)
    return _run_client(args, cfg.base_url, run_bench(cfg, progress=sys.stderr.isatty()), format_summary)


def _bench_multi_turn(args: argparse.Namespace) -> int:
    """``ferry bench serve --multi-turn`` (``bench/multi_turn.py``): 2 on a bad flag, 1 when the server cannot be
    reached or a turn failed."""
    from ferrylm.bench.multi_turn import MultiTurnConfig, format_multi_turn, run_multi_turn

    for flag, v in (("--num-conversations", args.num_conversations), ("--num-turns", args.num_turns),
                    ("--input-len", args.input_len), ("--output-len", args.output_len)):
        if v < 1:
            print(f"ferry bench serve: {flag} must be >= 1", file=sys.stderr)
            return 2
    if args.shared_prefix_len < 0:
        print("ferry bench serve: --shared-prefix-len must be >= 0", file=sys.stderr)
        return 2
    base_url = server_url(args)
    if base_url is None:
        return 2
    cfg = MultiTurnConfig(base_url=base_url, model=args.model,
                          num_conversations=args.num_conversations, num_turns=args.num_turns,
                          shared_prefix_len=args.shared_prefix_len, input_len=args.input_len,
                          output_len=args.output_len, vocab_upper=args.vocab_upper, seed=args.seed,
                          api_key=args.api_key)
    return _run_client(args, cfg.base_url, run_multi_turn(cfg), format_multi_turn)


def _run_client(args: argparse.Namespace, base_url: str, run, fmt) -> int:
    """Run a ``bench serve`` client coroutine ``run``, print ``fmt(summary)``, write ``--output-json``; 1 when the
    server cannot be reached or a request failed (one line, not a traceback), else 0."""
    import asyncio

    from ferrylm.bench.serve import BenchError

    try:
        summary = asyncio.run(run)
    except BenchError as e:
        print(f"ferry bench serve: {base_url}: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # connection refused and the like: one line, not a traceback
        print(f"ferry bench serve: cannot benchmark {base_url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    report(fmt(summary), summary, args.output_json)
    return 0 if summary["failed"] == 0 else 1
