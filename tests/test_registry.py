"""The registry of swappable parts (ferrylm/registry.py) and the three registries built on it."""

import sys

import pytest

from ferrylm.registry import Registry


def test_names_checked_against_the_flag():
    reg = Registry("--thing", {"a": "json:dumps", "b": "json:loads"})
    assert reg.names == ("a", "b") and "a" in reg and "c" not in reg
    assert reg.check("auto", extra=("auto",)) == "auto"
    with pytest.raises(ValueError, match=r"--thing must be one of auto, a, b, got 'c'"):
        reg.check("c", extra=("auto",))
    with pytest.raises(ValueError, match="--thing must be one of a, b"):
        reg.get("c")


def test_entries_imported_on_first_use_only():
    sys.modules.pop("colorsys", None)
    reg = Registry("--thing", {"hls": "colorsys:rgb_to_hls"})
    assert "colorsys" not in sys.modules
    assert reg.get("hls")(1.0, 0.0, 0.0) == (0.0, 0.5, 1.0)
    assert "colorsys" in sys.modules


def test_malformed_entry_refused():
    with pytest.raises(ValueError, match="'module:attribute'"):
        Registry("--thing", {"x": "json.dumps"})


def test_every_registered_part_resolves():
    from ferrylm.backends import ATTENTION_BACKENDS, CACHED_BACKENDS
    from ferrylm.experts.executor import ExpertExecutor
    from ferrylm.server.text.tool_parsers import TOOL_PARSERS
    from ferrylm.server.text.tool_parsers.base import ToolParser

    assert ATTENTION_BACKENDS.names == ("triton", "torch")
    assert all(callable(ATTENTION_BACKENDS.get(n)) for n in ATTENTION_BACKENDS.names)
    assert all(issubclass(CACHED_BACKENDS.get(n), ExpertExecutor) for n in CACHED_BACKENDS.names)
    for name in TOOL_PARSERS.names:
        cls = TOOL_PARSERS.get(name)
        assert issubclass(cls, ToolParser) and cls.MARKUP and cls.TEMPLATE_MARK
        assert cls(["f"], {}).feed("") == []
