"""What a new user's command lines met (issue 43): vLLM flags accepted with a note, sampling flags and serve flags
checked before anything loads, each error one line naming the flag under the command's own usage line."""

from __future__ import annotations

import argparse
import io

import pytest

from ferrylm import cli
from ferrylm.cli import build_parser, parse_args


def parse(argv: list[str]) -> argparse.Namespace:
    return parse_args(build_parser(), argv)


@pytest.fixture
def nothing_loads(monkeypatch):
    """Loading a model or starting a server fails the test: validation must come first."""
    import ferrylm.llm
    import ferrylm.server.process.launch

    def boom(*a, **k):
        raise AssertionError("loaded before validating the flags")

    monkeypatch.setattr(ferrylm.llm, "LLM", boom)
    monkeypatch.setattr(ferrylm.server.process.launch, "serve", boom)


def run_error(argv: list[str], capsys) -> str:
    """``argv`` must exit 2 with an argparse-style error; returns stderr."""
    with pytest.raises(SystemExit) as e:
        cli._main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


# ---- item 4: vLLM flags -------------------------------------------------------------------------------


def test_vllm_flags_people_copy_are_accepted_with_a_note() -> None:
    a = parse(["serve", "Qwen/Qwen3-30B-A3B", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               "--trust-remote-code", "--swap-space", "4", "--disable-log-requests"])
    assert a.model == "Qwen/Qwen3-30B-A3B" and a.tool_call_parser == "hermes"
    assert len(a.notes) == 4
    for flag in ("--enable-auto-tool-choice", "--trust-remote-code", "--swap-space", "--disable-log-requests"):
        (note,) = [n for n in a.notes if flag in n]
        assert "changes nothing" in note and "\n" not in note


def test_cors_flags_take_vllm_forms() -> None:
    a = parse(["serve", "--allowed-origins", '["https://a.example", "https://b.example"]', "--allowed-methods",
               "GET,POST", "--allowed-headers", "content-type", "--allowed-headers", "authorization",
               "--allow-credentials"])
    assert a.allowed_origins == ["https://a.example", "https://b.example"]
    assert (a.allowed_methods, a.allowed_headers, a.allow_credentials) == \
        (["GET", "POST"], ["content-type", "authorization"], True)
    d = parse(["serve"])
    assert (d.allowed_origins, d.allowed_methods, d.allowed_headers, d.allow_credentials) == (None, None, None, False)


# ---- item 5: sampling flags before loading ----------------------------------------------------------------


@pytest.mark.parametrize("argv,flag", [
    (["--max-tokens", "0"], "--max-tokens"), (["--max-tokens", "-3"], "--max-tokens"),
    (["--temperature", "-1"], "--temperature"), (["--top-p", "0"], "--top-p"), (["--top-k", "-2"], "--top-k"),
    (["--temperature", "nan"], "--temperature"),
])
def test_generate_checks_sampling_flags_before_loading(argv, flag, capsys, nothing_loads) -> None:
    err = run_error(["generate", *argv, "hi"], capsys)
    assert err.startswith("usage: ferry generate") and f"error: {flag} " in err and "Traceback" not in err


# ---- item 6: serve flags, with serve's usage line ----------------------------------------------------


@pytest.mark.parametrize("argv,needle", [
    (["--device", "cuda"], "--device cuda: no GPU is visible"),
    (["--device", "cuda:1"], "--device cuda:1: no GPU is visible"),
    (["--host", "no-such-host.invalid"], "--host 'no-such-host.invalid' does not resolve"),
    (["smollm2-135m", "--model", "smollm2-135m"], "as MODEL ('smollm2-135m') and as --model ('smollm2-135m')"),
    (["smollm2-135m", "--model", "smollm2-moe"], "as MODEL ('smollm2-135m') and as --model ('smollm2-moe')"),
    (["--served-model-name", ""], "--served-model-name must not be empty"),
    (["--served-model-name", "  "], "--served-model-name must not be empty"),
    (["--watchdog-timeout", "-1"], "--watchdog-timeout must be >= 0"),
    (["--request-timeout", "inf"], "--request-timeout must be >= 0 seconds"),
    (["--allowed-methods", "GET"], "--allowed-methods needs --allowed-origins"),
    (["--allow-credentials"], "--allow-credentials needs --allowed-origins"),
])
def test_serve_flag_errors_name_the_flag_under_serve_usage(argv, needle, capsys, monkeypatch, nothing_loads) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")   # a host without a GPU
    err = run_error(["serve", *argv], capsys)
    assert err.startswith("usage: ferry serve"), err
    assert needle in err and "ferry serve: error:" in err and err.count(needle) == 1, err


@pytest.mark.parametrize("argv,flag", [
    (["serve", "--port", "abc"], "--port"), (["serve", "--page-size", "0"], "--page-size"),
    (["serve", "--dtype", "int8"], "--dtype"), (["bench", "serve", "--concurrency", "x"], "--concurrency"),
])
def test_a_bad_flag_value_is_two_lines_not_the_whole_usage(argv, flag, capsys, nothing_loads) -> None:
    err = run_error(argv, capsys)
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("usage: ferry ") and "--help" in lines[0], err
    assert flag in lines[1] and ": error:" in lines[1], err


def test_listen_error_names_host_or_port() -> None:
    import errno

    from ferrylm.server.process.launch import listen_error

    assert listen_error("127.0.0.1", 80, OSError(errno.EADDRINUSE, "Address already in use")).endswith(
        "(choose another --port)")
    assert listen_error("192.0.2.1", 8000, OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")).endswith(
        "(choose another --host)")


# ---- trial 43, item 1: --max-tokens against the context -------------------------------------------------


@pytest.fixture
def tiny_model(monkeypatch) -> str:
    """A tiny synthetic MoE (context 128 tokens, token ids in and out) as ``--model``."""
    from ferrylm.synthetic.presets import PRESETS, SyntheticPreset
    from tests.models.test_synthetic import tiny

    monkeypatch.setitem(PRESETS, "tiny-cli", SyntheticPreset("tiny-cli", "test", tiny("qwen3-30b-a3b").config))
    return "synthetic:tiny-cli"


def generate_error(argv: list[str], capsys) -> str:
    """``ferry generate argv`` must return 2 with one ``ferry generate: ...`` line; returns that line."""
    assert cli._main(["generate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ferry generate: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_max_tokens_past_the_context_is_refused_before_the_weights_load(tiny_model, capsys, nothing_loads) -> None:
    err = generate_error(["--model", tiny_model, "--max-tokens", "99999", "1 2 3"], capsys)
    assert "--max-tokens 99999" in err and "128" in err
    err = generate_error(["--model", tiny_model, "--max-model-len", "32", "--max-tokens", "40", "1 2 3"], capsys)
    assert "--max-tokens 40" in err and "32" in err and "--max-model-len" in err


@pytest.mark.parametrize("argv,needle", [
    (["--max-model-len", "16", "--max-tokens", "10", " ".join(["5"] * 10)], "--max-tokens 10"),   # prompt + completion
    (["--max-model-len", "16", "--max-tokens", "2", " ".join(["5"] * 20)], "the prompt"),         # prompt alone
])
def test_a_request_the_context_cannot_hold_is_one_line_not_a_traceback(tiny_model, argv, needle, capsys) -> None:
    err = generate_error(["--model", tiny_model, "--device", "cpu", "--num-pages", "16", *argv], capsys)
    assert needle in err and "maximum context length is 16 tokens" in err, err


# ---- trial 43b, item 3: no prompt -----------------------------------------------------------------------


class _Stdin(io.StringIO):
    def __init__(self, text: str, tty: bool) -> None:
        super().__init__(text)
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("argv,stdin", [
    ([], _Stdin("", tty=False)),          # nothing piped
    ([], _Stdin("", tty=True)),           # a terminal: would wait for text unprompted
    ([""], _Stdin("ignored", tty=False)),  # an empty PROMPT
])
def test_generate_without_a_prompt_is_refused_before_loading(argv, stdin, monkeypatch, capsys, nothing_loads) -> None:
    monkeypatch.setattr("sys.stdin", stdin)
    err = generate_error(argv, capsys)
    assert err.startswith("ferry generate: a PROMPT is required"), err
    assert not stdin.tell(), "a terminal on stdin was read"


# ---- trial 43b, item 4: an unknown option, generate's help ----------------------------------------------


@pytest.mark.parametrize("argv,needle", [
    (["--bogus"], "ferry: error: unrecognized arguments: --bogus"),
    (["--bogus", "models"], "ferry: error: unrecognized arguments: --bogus"),
    (["bench", "--bogus"], "unrecognized arguments: --bogus"),
    (["serve", "--bogus-flag"], "ferry serve: error: unrecognized arguments: --bogus-flag"),
    (["bench", "serve", "--zz"], "ferry bench serve: error: unrecognized arguments: --zz"),
    ([], "ferry: error: a command is required: serve, bench, models, generate"),
    (["bench"], "ferry bench: error: a bench command is required: serve, suite, tables"),
])
def test_an_unknown_option_is_named_before_a_missing_command(argv, needle, capsys, nothing_loads) -> None:
    err = run_error(argv, capsys)
    assert needle in err and "the following arguments are required" not in err, err


def test_generate_does_not_list_the_flag_it_refuses(capsys, nothing_loads) -> None:
    with pytest.raises(SystemExit):
        cli._main(["generate", "--help"])
    text = capsys.readouterr().out
    assert "--max-tokens" in text and "--moe-backend" in text
    assert "--tensor-parallel-size" not in text and "--tp-size" not in text
    err = run_error(["generate", "--tensor-parallel-size", "2", "hi"], capsys)
    assert "--tensor-parallel-size 2 runs one engine process per rank: use `ferry serve`" in err, err
