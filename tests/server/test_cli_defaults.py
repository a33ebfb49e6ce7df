"""``ferry serve`` bounds every request's wait for its first step by default (issue 18: the queue timeout was off,
so a request could wait forever)."""

from __future__ import annotations

from ferrylm.cli import build_parser, engine_config_from_args


def test_serve_has_a_queue_timeout_by_default_and_0_turns_it_off():
    p = build_parser()
    assert engine_config_from_args(p.parse_args(["serve"])).queue_timeout == 600.0
    assert engine_config_from_args(p.parse_args(["serve", "--queue-timeout", "0"])).queue_timeout is None
    assert engine_config_from_args(p.parse_args(["serve", "--queue-timeout", "7.5"])).queue_timeout == 7.5
    assert engine_config_from_args(p.parse_args(["generate", "hi"])).queue_timeout is None
