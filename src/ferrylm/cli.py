"""``ferry`` command line: argument parsing into config objects, then hand-off. No serving logic here."""

from __future__ import annotations

import argparse
import logging
import sys

from ferrylm.server.process.boot_signals import BootInterrupted, BootSignals

# NOTE: first thing for `ferry serve`, before the imports below: a SIGTERM / SIGINT that arrives while they run is
# recorded (disarmed), not fatal; main() arms the handler and exits 0 if one came
_BOOT_SIGNALS = BootSignals().install(armed=False) if sys.argv[1:2] == ["serve"] else None

from typing import Any, Collection, Mapping

import ferrylm
from ferrylm.config import EngineConfig, ModelConfig
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.errors import InvalidRequest, ModelLoadError
from ferrylm.flags import add_flags, add_log_level, config_from_args
from ferrylm.server.api.context import DEFAULT_SSE_PING_INTERVAL
from ferrylm.server.text.tool_parsers import TOOL_PARSER_CHOICES

DEFAULT_MODEL = "smollm2-moe"
#: ``ferry serve``'s default ``--queue-timeout``, seconds
SERVE_QUEUE_TIMEOUT = 600.0


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("ferrylm")
    except Exception:  # noqa: BLE001 - running from a source tree
        return ferrylm.__version__


def _name_list(value: str) -> list[str]:
    """argparse type of the CORS flags: a JSON list (vLLM's form, ``'["https://a"]'``) or comma-separated names."""
    import json

    if value.lstrip().startswith("["):
        try:
            items = json.loads(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a JSON list") from None
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise argparse.ArgumentTypeError(f"{value!r} must be a JSON list of strings")
    else:
        items = value.split(",")
    return [x.strip() for x in items if x.strip()]


def port_number(value: str) -> int:
    """argparse type for ``--port``: an integer in 1..65535 (argparse names the flag in its error)."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {value!r}: expected an integer in 1..65535") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is out of range 1..65535")
    return port


#: vLLM ``serve`` flags people copy that change nothing here: flag -> (takes a value, why it changes nothing)
VLLM_NOOP_FLAGS: dict[str, tuple[bool, str]] = {
    "--trust-remote-code": (False, "ferrylm runs no code from checkpoints; its architectures are built in"),
    "--enable-auto-tool-choice": (False, "tool_choice 'auto' is always served (calls parsed per "
                                         "--tool-call-parser)"),
    "--enable-chunked-prefill": (False, "prefill is always chunked (--max-prefill-length)"),
    "--disable-log-requests": (False, "one line per finished request is logged at INFO (--log-level)"),
    "--disable-log-stats": (False, "engine figures are served at GET /metrics, not logged"),
    "--swap-space": (True, "preempted requests are recomputed, not swapped to host memory"),
    "--download-dir": (True, "nothing is downloaded: --model is a local folder, a .gguf file or a built-in name"),
    "--reasoning-parser": (True, "<think> blocks are split from the chat template's own markup"),
}


class _NoopFlag(argparse.Action):
    """A vLLM flag that changes nothing: parsed (with its value, if it takes one) and noted in
    ``namespace.notes`` (one line each, printed at start-up)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        note = f"note: {option_string} changes nothing here: {VLLM_NOOP_FLAGS[option_string][1]}"
        namespace.notes = [*namespace.notes, note]


def _add_vllm_noop_args(p: argparse.ArgumentParser) -> None:
    p.set_defaults(notes=[])
    for flag, (takes_value, why) in VLLM_NOOP_FLAGS.items():
        p.add_argument(flag, action=_NoopFlag, nargs=None if takes_value else 0, default=argparse.SUPPRESS,
                       metavar="VALUE" if takes_value else None, help=f"accepted for vLLM command lines; {why}")


def _add_model_args(p: argparse.ArgumentParser, *, defaults: Mapping[str, Any] | None = None,
                    extra_choices: Mapping[str, Mapping[str, str]] | None = None,
                    unlisted: Collection[str] = ()) -> None:
    """``--model``, ``--tokenizer``, every EngineConfig flag (keywords: :func:`ferrylm.flags.add_flags`'s), and
    ``--log-level``."""
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="built-in name (smollm2-moe, smollm2-135m), a local HF folder, a local .gguf file, or "
                        "synthetic:<preset>[:layers=N][:skew=A][:routing=R][:seed=S] (see `ferry models`) "
                        f"(default: {DEFAULT_MODEL})")
    p.add_argument("--tokenizer", default=None, metavar="FOLDER",
                   help="tokenizer folder for a synthetic: model (without it a synthetic model takes and prints "
                        "token ids; serving needs one)")
    add_flags(p, EngineConfig, defaults=defaults, extra_choices=extra_choices, unlisted=unlisted)
    add_log_level(p, "INFO")


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    """Build and validate the EngineConfig. Raises ValueError naming the flag."""
    return config_from_args(EngineConfig, a).validate()


def sampling_params_from_args(a: argparse.Namespace) -> SamplingParams:
    """``ferry generate``'s sampling flags, checked before anything loads. Raises ValueError naming the flag."""
    try:
        return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                              top_k=a.top_k).validate()
    except InvalidRequest as e:
        field = e.param or ""
        raise ValueError(e.message.replace(f"'{field}'", "--" + field.replace("_", "-"))) from None


class _Parser(argparse.ArgumentParser):
    """argparse with a short error: one usage line pointing at ``--help`` and the error naming the flag (the full
    usage of ``ferry serve`` is 35 lines, which buried the one that matters)."""

    def error(self, message: str):
        self.exit(2, f"usage: {self.prog} [options] (all of them: {self.prog} --help)\n"
                     f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from ferrylm.bench.cli import add_bench_parser

    parser = _Parser(prog="ferry", description="ferrylm: serve MoE LLMs larger than your GPU")
    parser.set_defaults(usage_parser=parser)   # a command's own parser replaces it: its usage line on errors
    parser.add_argument("--version", action="version", version=f"ferry (ferrylm) {_version()}",
                        help="print the version and exit")
    # NOTE: not required=True: argparse would then name the missing command before an unknown option
    # (`ferry --bogus`); parse_args() asks for the command once the options are known
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve_parser(sub)
    add_bench_parser(sub, model_args=_add_model_args, port=port_number, default_model=DEFAULT_MODEL)
    sub.add_parser("models", help="list built-in models, synthetic presets and supported architectures")
    _add_generate_parser(sub)
    return parser


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    s.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                   help="the model, as vLLM takes it (`ferry serve MODEL`); the same as --model")
    # NOTE: a bound on every request's wait for its first step, so none waits forever (aging bounds it under a
    # stream of smaller arrivals; this bounds it whatever the load)
    _add_model_args(s, defaults={"queue_timeout": SERVE_QUEUE_TIMEOUT})
    s.set_defaults(model=None, usage_parser=s)   # None: --model not given (the positional may be)
    _add_vllm_noop_args(s)
    s.add_argument("--chat-template", default=None, metavar="FILE_OR_JINJA",
                   help="chat template replacing the tokenizer's: a file path, or the Jinja text itself (default: "
                        "the tokenizer's own)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    s.add_argument("--port", type=port_number, default=8000, help="port (default: 8000)")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model id(s) clients use, as vLLM takes them: each is accepted in `model` and listed by "
                        "/v1/models; responses report the first (default: the model's name)")
    s.add_argument("--api-key", default=None, help="require this bearer key on /v1/* (env FERRYLM_API_KEY)")
    s.add_argument("--tool-call-parser", default="auto", choices=TOOL_PARSER_CHOICES,
                   help="tool-call format of the model's output (vLLM's names): hermes (<tool_call>{json}), glm45 "
                        "(GLM-4.5/4.6 <tool_call>name<arg_key>...), minimax_m2 (<minimax:tool_call><invoke ...>), "
                        "deepseek_v3 (DeepSeek-V3/V3.1/R1 <｜tool▁calls▁begin｜>...), kimi_k2 "
                        "(<|tool_calls_section_begin|>...), qwen3_coder (Qwen3-Coder/Qwen3-Next/Qwen3.5 "
                        "<tool_call><function=...>); auto (default): from the chat template's markup, then the "
                        "config's model_type, then the architecture, else hermes")
    s.add_argument("--max-request-bytes", type=int, default=8 << 20, metavar="N",
                   help="refuse request bodies larger than N bytes with 413 (default: 8 MiB)")
    s.add_argument("--sse-ping-interval", type=float, default=DEFAULT_SSE_PING_INTERVAL, metavar="S",
                   help="seconds of silence in a stream (queued, a long prefill) after which a keep-alive is sent "
                        "(the SSE comment ': ping', Anthropic's ping event), and a stream's first byte goes out "
                        "with its headers, so clients and proxies keep the connection (0: never; default "
                        f"{DEFAULT_SSE_PING_INTERVAL:g})")
    s.add_argument("--responses-store-size", type=int, default=1024, metavar="N",
                   help="responses kept in memory for the Responses API's previous_response_id (oldest evicted "
                        "first; default 1024)")
    _add_serve_guard_args(s)


def _add_serve_guard_args(s: argparse.ArgumentParser) -> None:
    """CORS, the web page, and the server's restart, watchdog and timeout limits."""
    s.add_argument("--allowed-origins", type=_name_list, action="extend", default=None,
                   metavar="ORIGIN",
                   help="CORS: origins browsers may call from ('*' for any), as vLLM takes them: a JSON list, "
                        "or comma-separated, or the flag repeated; CORS is off when not set (default: off)")
    s.add_argument("--allowed-methods", type=_name_list, action="extend", default=None,
                   metavar="METHOD", help="CORS: methods a preflight allows (needs --allowed-origins; default: *)")
    s.add_argument("--allowed-headers", type=_name_list, action="extend", default=None,
                   metavar="HEADER",
                   help="CORS: request headers a preflight allows (needs --allowed-origins; default: *)")
    s.add_argument("--allow-credentials", action="store_true",
                   help="CORS: let browsers send cookies / credentials (needs --allowed-origins; default: off)")
    s.add_argument("--webui", action=argparse.BooleanOptionalAction, default=True,
                   help="serve the web page at / (chat, and a live view of the memory plan, the expert cache and "
                        "the engine; its data at GET /v1/live, behind --api-key); --no-webui: neither (default: on)")
    s.add_argument("--max-engine-restarts", type=int, default=3,
                   help="engine restarts allowed within 10 minutes before the server exits non-zero (default: 3)")
    s.add_argument("--watchdog-timeout", type=float, default=120.0,
                   help="seconds with requests running but no completed engine step (or no engine heartbeat) "
                        "before the engine's stacks are logged and it is restarted; 0 = off (default: 120)")
    s.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="server-side deadline of a request, counted from its arrival: past it the engine stops it "
                        "and the client gets 408 request_timeout (an SSE error event when streaming); a request's "
                        "x-request-timeout header overrides it; 0 = none (default: 600)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds running requests may take to finish before they are "
                        "answered with an error and the server exits (default: 30)")


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="print a completion without a server")
    _add_model_args(g, unlisted=("tensor_parallel_size",))   # one engine in this process: refused, with why
    g.set_defaults(usage_parser=g)
    g.add_argument("prompt", nargs="?", default=None,
                   help="prompt text (default: stdin, when it is not a terminal); for a synthetic model without "
                        "--tokenizer, token ids such as '1 2 3' (default: a fixed 16-token prompt)")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1)")
    g.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest tokens; -1 = off (default)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; ``ferry serve MODEL`` (vLLM's positional form) sets ``--model``. An unknown option is named
    before a missing command, under the usage line of the command it was given to."""
    args, extra = parser.parse_known_args(argv)
    if extra:   # named by the command that was given (argparse names the top-level program)
        args.usage_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.error(f"a command is required: {', '.join(_commands(parser))}")
    if args.command == "bench" and args.bench_command is None:
        args.usage_parser.error(f"a bench command is required: {', '.join(_commands(args.usage_parser))}")
    if args.command == "serve":
        if args.model_pos is not None and args.model is not None:
            args.usage_parser.error(f"the model is given twice: as MODEL ({args.model_pos!r}) and as --model "
                                    f"({args.model!r}); give one")
        if args.model_pos is None and args.model is None and len(args.served_model_name or ()) > 1:
            args.notes = [*args.notes, f"serving {DEFAULT_MODEL} as {' / '.join(args.served_model_name)} (MODEL goes "
                                       f"first, or in --model: --served-model-name takes every word after it)"]
        args.model = args.model_pos or args.model or DEFAULT_MODEL
    return args


def _commands(parser: argparse.ArgumentParser) -> list[str]:
    """The names of ``parser``'s commands (its subparsers)."""
    return [name for a in parser._actions if isinstance(a, argparse._SubParsersAction) for name in a.choices]


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv)[:1] != ["serve"]:
        return _main(argv)
    # NOTE: before anything slow: a SIGTERM during start-up must exit 0, not kill us by its default action
    boot = _BOOT_SIGNALS or BootSignals().install(armed=False)
    try:
        boot.armed = True
        if boot.received:
            return 0  # signalled while the modules imported: nothing was started yet
        return _main(argv, boot)
    except BootInterrupted:
        return 0  # nothing was started yet


def _main(argv: list[str] | None, boot=None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    if args.command == "models":
        from ferrylm.checkpoints.catalog import describe_models

        print(describe_models())
        return 0
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    usage = args.usage_parser   # errors print the command's own usage line, as argparse's do
    if args.command == "bench":
        from ferrylm.bench.cli import run as run_bench

        return run_bench(args)
    try:
        engine_config = engine_config_from_args(args)
        params = sampling_params_from_args(args) if args.command == "generate" else None
    except ValueError as e:
        usage.error(str(e))
    tokenizer_error = _apply_tokenizer_flag(args)
    if tokenizer_error:
        usage.error(tokenizer_error)
    if args.command == "serve":
        from ferrylm.server.process.launch import check_serve_args, serve

        flag_error = check_serve_args(args, engine_config)
        if flag_error:
            usage.error(flag_error)
        for note in args.notes:
            print(f"ferry serve: {note}", file=sys.stderr)
        return serve(args, engine_config, boot)
    if args.command == "generate":
        if engine_config.tensor_parallel_size > 1:
            usage.error(f"--tensor-parallel-size {engine_config.tensor_parallel_size} runs one engine process per "
                        f"rank: use `ferry serve` (generate runs the engine in this process)")
        return _generate(args, engine_config, params)
    parser.error(f"unknown command {args.command}")
    return 2


def _apply_tokenizer_flag(args: argparse.Namespace) -> str | None:
    """Fold ``--tokenizer`` into a synthetic ``--model`` spec (``:tokenizer=<abs path>``, so every reader of the
    spec sees it); return an error message, or None."""
    from ferrylm.synthetic.spec import is_synthetic_spec, parse_synthetic_spec, with_tokenizer

    try:
        if is_synthetic_spec(args.model):
            parse_synthetic_spec(args.model)   # an unknown preset is named before a missing --tokenizer
        args.model = with_tokenizer(args.model, args.tokenizer)
    except ModelLoadError as e:
        return e.message
    if args.command == "serve" and is_synthetic_spec(args.model) and ":tokenizer=" not in args.model:
        return f"serving {args.model} needs --tokenizer FOLDER (the HTTP API speaks text)"
    return None


def _generate(args: argparse.Namespace, engine_config: EngineConfig, params: SamplingParams) -> int:
    """``ferry generate``: print one completion. Returns the exit status (2 with one ``ferry generate: ...`` line
    for a request the model cannot serve)."""
    from ferrylm.synthetic.spec import is_synthetic_spec

    ids_only = is_synthetic_spec(args.model) and ":tokenizer=" not in args.model  # token ids in and out
    if ids_only:
        if args.chat:
            return _generate_error("--chat needs a tokenizer (--tokenizer FOLDER)")
        try:
            prompt = [int(t) for t in (args.prompt or "").replace(",", " ").split()]
        except ValueError:
            return _generate_error(f"{args.model} has no tokenizer: the prompt must be token ids such as '1 2 3'")
    else:
        # no PROMPT with a terminal on stdin would wait, unprompted, for text: refused as an empty one is
        prompt = args.prompt if args.prompt is not None else "" if sys.stdin.isatty() else sys.stdin.read()
        if not prompt:
            return _generate_error('a PROMPT is required: `ferry generate "text"`, or the text piped on stdin')
    llm = _load_for_generate(args, engine_config, params)
    if isinstance(llm, str):
        return _generate_error(llm)
    try:
        if ids_only:
            from ferrylm.synthetic.spec import default_prompt_ids

            vocab = llm.engine.mcfg.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                return _generate_error(f"token ids must lie in [0, {vocab})")
            out = llm.generate([prompt or default_prompt_ids(vocab)], params)[0]
            print(" ".join(str(t) for t in out.outputs[0].token_ids))
            return 0
        if args.chat:
            out = llm.chat([[{"role": "user", "content": prompt}]], params)[0]
        else:
            out = llm.generate([prompt], params)[0]
    except InvalidRequest as e:   # the prompt or --max-tokens does not fit the context, an empty prompt ...
        flag = f"--max-tokens {params.max_tokens}: " if e.param == "max_tokens" else ""
        return _generate_error(flag + e.message)
    print(out.outputs[0].text)
    return 0


def _load_for_generate(args: argparse.Namespace, engine_config: EngineConfig, params: SamplingParams):
    """The offline engine for ``ferry generate``, or the error line when the model cannot be loaded or
    ``--max-tokens`` cannot fit its context (checked once its config is read, before the weights load)."""
    from ferrylm.checkpoints.resolve import resolve_model
    from ferrylm.experts.cpu_kernel import KernelBuildError
    from ferrylm.llm import LLM

    try:
        resolved = resolve_model(args.model)
        context = ModelConfig.from_folder(resolved.path).max_position_embeddings
        limit = engine_config.max_model_len or context
        if params.max_tokens >= limit:   # the prompt takes at least one token of the context
            where = "--max-model-len" if engine_config.max_model_len else "the model's context"
            return (f"--max-tokens {params.max_tokens} does not fit the context of {limit} tokens ({where}) with "
                    f"a prompt: give at most {limit - 1}, less the prompt's tokens")
        return LLM(resolved, engine_config=engine_config)
    except (ModelLoadError, KernelBuildError) as e:
        return e.message
    except ValueError as e:  # a flag out of range or a device that is not there (the message names the flag)
        return str(e)


def _generate_error(message: str) -> int:
    print(f"ferry generate: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
