"""Flags declared once on config fields (``ferrylm/flags.py``, issue 41 item 4): the parser is built from the
field (type, default, choices, aliases, help with the default) and the config from the namespace."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import pytest

from ferrylm.cli import build_parser, engine_config_from_args, parse_args
from ferrylm.config import EngineConfig
from ferrylm.flags import add_flags, config_from_args, flag, flagged_fields, option


@dataclass(frozen=True)
class Toy:
    size: int = flag(4, "how many", aliases=("--count",), metavar="N")
    ratio: float | None = flag(None, "a share", default_text="chosen at start", convert=lambda v: v or None)
    mode: str = flag("a", "which mode", choices=("a", "b"))
    fast: bool = flag(True, "go fast")
    trace: bool = flag(False, "log more", name="--debug-trace")
    graphs: str = flag("auto", "no graphs", name="--eager", switch="off")
    hidden: int = 7


def _parser(**kw) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toy")
    add_flags(p, Toy, **kw)
    return p


def _help(p: argparse.ArgumentParser, opt: str) -> str:
    return next(a.help for a in p._actions if opt in a.option_strings)


def test_defaults_make_the_default_config() -> None:
    assert config_from_args(Toy, _parser().parse_args([])) == Toy()


def test_each_spelling_reaches_its_field() -> None:
    p = _parser()
    got = config_from_args(Toy, p.parse_args(["--count", "9", "--ratio", "0.5", "--mode", "b", "--no-fast",
                                              "--debug-trace", "--eager"]))
    assert got == Toy(size=9, ratio=0.5, mode="b", fast=False, trace=True, graphs="off")
    assert config_from_args(Toy, p.parse_args(["--size", "3", "--ratio", "0"])) == Toy(size=3, ratio=None)
    assert config_from_args(Toy, p.parse_args([]), hidden=1).hidden == 1


def test_types_and_choices_come_from_the_field() -> None:
    p = _parser()
    for argv in (["--size", "x"], ["--mode", "c"], ["--ratio", "half"]):
        with pytest.raises(SystemExit):
            p.parse_args(argv)
    assert not any("--hidden" in a.option_strings for a in p._actions)


def test_help_states_the_default_once_from_the_field() -> None:
    p = _parser(defaults={"size": 12}, extra_choices={"mode": {"all": "every mode"}})
    assert _help(p, "--size") == "how many (default: 12)"
    assert _help(p, "--ratio") == "a share (default: chosen at start)"
    assert _help(p, "--mode") == "which mode; all: every mode (default: a)"
    assert _help(p, "--fast") == "go fast (default: on)" and _help(p, "--eager") == "no graphs (default: off)"
    assert p.parse_args([]).size == 12 and p.parse_args(["--mode", "all"]).mode == "all"


def test_a_none_default_must_say_what_none_means() -> None:
    @dataclass(frozen=True)
    class Bad:
        limit: int | None = flag(None, "a limit")

    with pytest.raises(TypeError, match="'limit'.*default_text"):
        add_flags(argparse.ArgumentParser(), Bad)


def test_option_names_the_field_flag() -> None:
    assert option(EngineConfig, "check_invariants") == "--debug-invariants"
    assert option(EngineConfig, "max_running_requests") == "--max-running-requests"
    with pytest.raises(KeyError):
        option(EngineConfig, "kv_memory_fraction")


def _other_value(f: dataclasses.Field, action: argparse.Action) -> tuple[list[str], object]:
    """The value words giving ``f`` a value other than its default, and that value."""
    fl = f.metadata["flag"]
    if fl.switch is not None or isinstance(f.default, bool):
        return [], fl.switch if fl.switch is not None else not f.default
    if action.choices:
        value = next(c for c in action.choices if c not in (f.default, "fused"))
        return [value], value
    if action.type is int:
        return ["5"], 5
    if action.type is float:
        return ["0.25"], 0.25
    return ["some-text"], "some-text"


def test_every_engine_flag_and_alias_reaches_its_field() -> None:
    """Each EngineConfig flag, by its name and by each alias, sets its field (nothing copied field by field)."""
    parser = build_parser()
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    for f, fl in flagged_fields(EngineConfig):
        for opt in (option(EngineConfig, f.name), *fl.aliases):
            action = next(a for a in serve._actions if opt in a.option_strings)
            words, value = _other_value(f, action)
            if f.default is True:
                opt = "--no-" + opt[2:]
            cfg = config_from_args(EngineConfig, parse_args(parser, ["serve", opt, *words]))
            assert getattr(cfg, f.name) == value, (opt, words)


def test_each_command_default_config() -> None:
    p = build_parser()
    assert engine_config_from_args(parse_args(p, ["generate"])) == EngineConfig()
    assert engine_config_from_args(parse_args(p, ["serve"])) == EngineConfig(queue_timeout=600.0)
    assert engine_config_from_args(parse_args(p, ["bench", "decode"])) == EngineConfig(moe_backend="all")
    assert engine_config_from_args(parse_args(p, ["serve", "--moe-backend", "fused"])).moe_backend == "resident"


def test_log_level_in_any_case_and_a_clear_error_otherwise(capsys) -> None:
    import pytest

    assert build_parser().parse_args(["serve", "--model", "m", "--log-level", "debug"]).log_level == "DEBUG"
    assert build_parser().parse_args(["bench", "bw", "--log-level", "Warning"]).log_level == "WARNING"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--log-level", "verbose"])
    assert "--log-level: invalid choice: 'VERBOSE'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "bw", "--log-level", "loud"])
    assert "--log-level: invalid choice" in capsys.readouterr().err


def test_developer_flags_are_accepted_and_left_out_of_help(capsys) -> None:
    """--faults and --debug-invariants (tests, debugging) parse on `ferry serve` and stay out of its --help,
    which names no source files."""
    args = parse_args(build_parser(), ["serve", "--faults", "prefill_workspace:times=1", "--debug-invariants"])
    cfg = engine_config_from_args(args)
    assert cfg.faults == "prefill_workspace:times=1" and cfg.check_invariants
    with pytest.raises(SystemExit):
        parse_args(build_parser(), ["serve", "--help"])
    out = capsys.readouterr().out
    assert "--max-model-len" in out
    assert "--faults" not in out and "--debug-invariants" not in out and ".py)" not in out
