"""vLLM users' flags (issue 26): ``ferry serve MODEL``, --gpu-memory-utilization, --max-num-seqs,
--max-num-batched-tokens, --chat-template, ``ferry --version``; help text on every flag; httpx a dependency."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from ferrylm.cli import build_parser, engine_config_from_args, parse_args
from ferrylm.errors import ModelLoadError
from ferrylm.server.text.tokenizer import TextCodec, load_chat_template

ROOT = Path(__file__).resolve().parents[2]


def parse(argv: list[str]) -> argparse.Namespace:
    return parse_args(build_parser(), argv)


def test_positional_model() -> None:
    assert parse(["serve", "synthetic:tiny-moe"]).model == "synthetic:tiny-moe"
    assert parse(["serve", "--model", "smollm2-135m"]).model == "smollm2-135m"
    assert parse(["serve", "smollm2-135m", "--port", "8001"]).model == "smollm2-135m"
    with pytest.raises(SystemExit):
        parse(["serve", "smollm2-135m", "--model", "smollm2-moe-other"])


def test_vllm_aliases_map_to_ours() -> None:
    a = parse(["serve", "--gpu-memory-utilization", "0.5", "--max-num-seqs", "7", "--max-num-batched-tokens",
               "1024"])
    cfg = engine_config_from_args(a)
    assert (cfg.memory_ratio, cfg.max_running_requests, cfg.max_prefill_length) == (0.5, 7, 1024)


def test_version_flag() -> None:
    r = subprocess.run([sys.executable, "-m", "ferrylm.cli", "--version"], capture_output=True, text=True,
                       timeout=60, env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ferry (ferrylm) ") and r.stdout.strip().split()[-1][0].isdigit()


def _all_parsers(p: argparse.ArgumentParser):
    yield p
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                yield from _all_parsers(sub)


def test_every_flag_has_help_text() -> None:
    missing = [f"{p.prog} {'/'.join(a.option_strings) or a.dest}" for p in _all_parsers(build_parser())
               for a in p._actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not (a.help or "").strip()]
    assert not missing, missing


def test_chat_template_from_a_file_inline_or_refused(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    inline = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    f = tmp_path / "t.jinja"
    f.write_text(inline)
    assert load_chat_template(str(f)) == inline
    assert load_chat_template(inline) == inline
    with pytest.raises(ModelLoadError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ModelLoadError, match="not a valid Jinja"):
        load_chat_template("{% for m in messages %}")
    c = TextCodec.from_pretrained(tiny_tokenizer_dir)   # a codec of its own: the session's stays as it is
    c.set_chat_template(inline)
    text = c.decode(c.apply_chat_template([{"role": "user", "content": "hi"}]), skip_special_tokens=False)
    assert text.startswith("[user] hi")


def test_httpx_is_a_runtime_dependency() -> None:
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.replace(" ", "").startswith("httpx") for d in deps), deps
