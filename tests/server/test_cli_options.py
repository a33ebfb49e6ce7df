"""The ``ferry`` parser generated from the config fields (issue 41 item 4) takes exactly the options the hand-written
one took: names, aliases, dest, defaults, choices, nargs, type and action of every option of every subcommand, as
``fixtures/cli_options_before.json`` recorded them (help text may differ)."""

from __future__ import annotations

import json
from pathlib import Path

from ferrylm.cli import build_parser
from tests.server.cli_options import dump

FIXTURE = Path(__file__).parent / "fixtures" / "cli_options_before.json"


def test_every_option_of_every_command_is_as_before() -> None:
    before = json.loads(FIXTURE.read_text())
    now = json.loads(json.dumps(dump(build_parser()), default=str))
    assert sorted(now) == sorted(before), (sorted(set(now) - set(before)), sorted(set(before) - set(now)))
    changed = {key: (before[key], now[key]) for key in before if now[key] != before[key]}
    assert not changed, changed
