"""Every `ferry` subcommand's options as data (option strings, dest, default, choices, nargs, type, action):
``python -m tests.server.cli_options > tests/server/fixtures/cli_options_before.json`` captured the parser before
it was generated from the config; test_cli_options.py compares the parser of now with it."""

from __future__ import annotations

import argparse
import json
import sys

from ferrylm.cli import build_parser


def dump(p: argparse.ArgumentParser, prefix: str = "") -> dict:
    out = {}
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sp in a.choices.items():
                out.update(dump(sp, f"{prefix}{name} "))
            continue
        if isinstance(a, argparse._HelpAction):
            continue
        d = "==SUPPRESS==" if a.default is argparse.SUPPRESS else a.default
        out[f"{prefix}{a.dest}|{','.join(a.option_strings) or 'positional'}"] = {
            "options": sorted(a.option_strings), "dest": a.dest, "default": d if isinstance(d, (int, float, str, bool, type(None), list)) else repr(d),
            "choices": list(a.choices) if a.choices is not None else None,
            "nargs": a.nargs, "type": getattr(a.type, "__name__", None),
            "action": type(a).__name__}
    return out


if __name__ == "__main__":
    json.dump(dump(build_parser()), sys.stdout, indent=1, sort_keys=True, default=str)
