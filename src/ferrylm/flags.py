"""Command-line flags declared on config dataclass fields.

A field carries its flag once, next to its default: ``page_size: int = flag(16, "tokens per KV page")``.
:func:`add_flags` adds every flagged field of a config class to an argparse parser (type from the annotation,
choices, aliases, help ending in the default) and :func:`config_from_args` builds the config from the parsed
namespace. No torch import: the backends' names come from ``ferrylm/backends.py``, not from their packages.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping, Sequence



@dataclass(frozen=True)
class Flag:
    """How one config field is spelled on the command line.

    Attributes:
        help: what the flag does, without its default (the help adds ``(default: ...)``).
        name: the option; None = ``--`` + the field name with dashes. The namespace key (argparse ``dest``) is
            the option without dashes.
        aliases: other spellings of the same option (vLLM's, SGLang's).
        metavar: argparse metavar.
        choices: the allowed values.
        default_text: how the help states the default; required when the default is None (None = "auto":
            say what is chosen).
        switch: a ``store_true`` flag that sets a non-bool field to this value (``--enforce-eager`` sets
            ``decode_graphs`` to ``"off"``); unset, the field keeps its default.
        convert: the parsed value -> the field's value (``0`` meaning off, a spelling folded to its name).
        hidden: a developer's flag (tests, debugging): accepted, left out of ``--help``.
    """

    help: str
    name: str | None = None
    aliases: tuple[str, ...] = ()
    metavar: str | None = None
    choices: Sequence[str] | None = None
    default_text: str | None = None
    switch: Any = None
    convert: Callable[[Any], Any] | None = None
    hidden: bool = False


def flag(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with ``default`` and a :class:`Flag` (keywords as its attributes)."""
    return dataclasses.field(default=default, metadata={"flag": Flag(help=help, **kw)})


def flagged_fields(cls: type) -> list[tuple[dataclasses.Field, Flag]]:
    """``cls``'s fields that carry a flag, in declaration order."""
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(cls) if "flag" in f.metadata]


def option(cls: type, field_name: str) -> str:
    """The option of ``cls``'s field ``field_name`` (``--page-size``). KeyError for a field without a flag."""
    for f, fl in flagged_fields(cls):
        if f.name == field_name:
            return _name(f, fl)
    raise KeyError(f"{cls.__name__}.{field_name} has no flag")


def add_flags(parser: argparse.ArgumentParser, cls: type, *, defaults: Mapping[str, Any] | None = None,
              extra_choices: Mapping[str, Mapping[str, str]] | None = None, unlisted: Collection[str] = ()) -> None:
    """Add an argument for every flagged field of the dataclass ``cls``.

    Args:
        defaults: field -> this parser's own default (``ferry serve``'s queue timeout); the help states it.
        extra_choices: field -> {value: what it means}, values this parser accepts besides the field's choices
            (``ferry bench decode --moe-backend all``); their meanings are added to the help.
        unlisted: fields whose flag this parser accepts (to refuse it with a reason) but leaves out of its help.
    Raises:
        TypeError: a field whose type has no flag form, or a None default without ``default_text``.
    """
    hints = typing.get_type_hints(cls)
    defaults, extra_choices = defaults or {}, extra_choices or {}
    for f, fl in flagged_fields(cls):
        default = defaults.get(f.name, f.default)
        extra = extra_choices.get(f.name, {})
        help_text = fl.help + "".join(f"; {value}: {meaning}" for value, meaning in extra.items())
        kw: dict[str, Any] = {"dest": _dest(f, fl), "help": help_text}
        kind = _scalar_type(hints[f.name], f.name)
        if fl.switch is not None or kind is bool:
            kw.update(action=argparse.BooleanOptionalAction if default is True else "store_true",
                      default=False if fl.switch is not None else default)
            shown = "on" if default is True else "off"
        else:
            kw.update(default=default, type=None if kind is str else kind, metavar=fl.metavar)
            if fl.choices is not None:
                kw["choices"] = [*fl.choices, *extra]
            shown = _shown(f, fl, default)
        kw["help"] = argparse.SUPPRESS if f.name in unlisted or fl.hidden else kw["help"] + f" (default: {shown})"
        parser.add_argument(_name(f, fl), *fl.aliases, **kw)


def config_from_args(cls: type, args: argparse.Namespace, **values: Any) -> Any:
    """``cls`` built from the namespace of a parser :func:`add_flags` filled; ``values`` set fields without a
    flag. Fields without a flag and not in ``values`` keep their defaults."""
    for f, fl in flagged_fields(cls):
        given = getattr(args, _dest(f, fl))
        if fl.switch is not None:
            given = fl.switch if given else f.default
        values[f.name] = fl.convert(given) if fl.convert else given
    return cls(**values)


def _name(f: dataclasses.Field, fl: Flag) -> str:
    return fl.name or "--" + f.name.replace("_", "-")


def _dest(f: dataclasses.Field, fl: Flag) -> str:
    """The namespace key: the option without dashes, as argparse names it."""
    return _name(f, fl).lstrip("-").replace("-", "_")


def _scalar_type(hint: Any, field_name: str) -> type:
    """``int`` for ``int`` and ``int | None`` (likewise float, str, bool)."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    kinds = [a for a in args if a is not type(None)]
    if len(kinds) != 1 or kinds[0] not in (int, float, str, bool):
        raise TypeError(f"field {field_name!r}: a flag needs an int, float, str or bool field, not {hint}")
    return kinds[0]


def _shown(f: dataclasses.Field, fl: Flag, default: Any) -> str:
    if default is f.default and fl.default_text is not None:
        return fl.default_text
    if default is None:
        raise TypeError(f"field {f.name!r}: a flag with a None default needs default_text (what None means)")
    return format(default, "g") if isinstance(default, float) else str(default)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def add_log_level(parser: argparse.ArgumentParser, default: str) -> None:
    """``--log-level``: one of :data:`LOG_LEVELS`, in any case (``debug`` as uvicorn and vLLM take it)."""
    parser.add_argument("--log-level", default=default, type=str.upper, choices=LOG_LEVELS,
                        help="logging level (default: %(default)s)")
