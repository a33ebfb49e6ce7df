"""Call assembly every tool-call format shares: the request's tools (:class:`RequestTools`) decide whether a written
call names one of them, type its argument values by the tool's parameter schema (:func:`coerce_value`) and build the
:class:`~ferrylm.server.text.tool_parsers.base.ToolCall`: arguments as JSON text of an object (JSON formats: an
object, or a JSON string holding one), the model's id when the format writes one, else a fresh id; the call an output
ended in as an unfinished call (its arguments' JSON text so far). A parser keeps only its format's markup.

This module must not import torch.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterable, Mapping, TypeVar

from ferrylm.server.text.tool_parsers.base import ToolCall, cut_arguments, decode_arguments

V = TypeVar("V")


def coerce_value(text: str, schema: Any) -> Any:
    """One argument's text as a JSON value, by its property ``schema`` (None: not in the schema).

    ``type`` ``string`` (or a list of types holding ``string``): the text itself. Otherwise ``json.loads`` of the
    stripped text; when that fails, the text as a string (what the reference parsers do).
    """
    types = schema.get("type") if isinstance(schema, dict) else None
    if types == "string" or (isinstance(types, list) and "string" in types):
        return text
    try:
        return json.loads(text.strip())
    except (ValueError, RecursionError):
        return text


def _made(name: str, arguments: str, call_id: str | None, complete: bool = True) -> ToolCall:
    """A :class:`ToolCall` with the model's ``call_id``, or a fresh id when it wrote none."""
    if call_id is None:
        return ToolCall(name, arguments, complete=complete)
    return ToolCall(name, arguments, call_id, complete=complete)


class RequestTools:
    """The request's tools as a parser sees them.

    Args:
        tool_names: the request's tools; a call naming another function is not a call. None: any name.
        schemas: ``name -> parameters`` JSON schema, for typing values (absent tools: values read as JSON).
    """

    def __init__(self, tool_names: Iterable[str] | None = None, schemas: Mapping[str, dict] | None = None):
        self.names = None if tool_names is None else frozenset(tool_names)
        self.schemas = dict(schemas or {})

    def known(self, name: Any) -> bool:
        """Whether ``name`` is one of the request's tools (any non-empty string when the names are None)."""
        return isinstance(name, str) and bool(name) and (self.names is None or name in self.names)

    def arguments(self, name: str, pairs: Iterable[tuple[str, V]],
                  value: Callable[[V, Any], Any] = coerce_value) -> dict | None:
        """The arguments of a call of ``name`` from its written ``(key, raw value)`` pairs, each value typed by
        ``value(raw, property schema)``; None for an unknown tool or a key given twice."""
        if not self.known(name):
            return None
        props = (self.schemas.get(name) or {}).get("properties") or {}
        args: dict[str, Any] = {}
        for key, raw in pairs:
            if key in args:
                return None
            args[key] = value(raw, props.get(key))
        return args

    def call(self, name: str, args: dict | None, call_id: str | None = None) -> ToolCall | None:
        """The whole call of ``name`` with ``args`` (None: not a call, as :meth:`arguments` answers)."""
        if args is None or not self.known(name):
            return None
        return _made(name, json.dumps(args, ensure_ascii=False), call_id)

    def cut_call(self, name: str, args: dict | None, call_id: str | None = None) -> ToolCall | None:
        """The unfinished call of ``name`` whose whole pairs so far are ``args``: its arguments the JSON text of
        those values without the closing brace (:func:`~ferrylm.server.text.tool_parsers.base.cut_arguments`)."""
        if args is None or not self.known(name):
            return None
        return _made(name, cut_arguments(args), call_id, complete=False)

    def json_call(self, name: str, arguments: str, call_id: str | None = None) -> ToolCall | None:
        """A call of ``name`` whose arguments are JSON text of an object (or a JSON string holding one); None for
        an unknown tool or other arguments."""
        if not self.known(name):
            return None
        try:
            args = decode_arguments(json.loads(arguments))
        except (ValueError, RecursionError):   # a model may nest past the recursion limit
            return None
        return self.call(name, args, call_id)

    def json_cut(self, name: str, arguments: str, call_id: str | None = None) -> ToolCall | None:
        """The call of ``name`` the output ended in, its arguments the JSON text so far: whole when that text is a
        whole object already (:meth:`json_call`), else unfinished; None for an unknown tool."""
        whole = self.json_call(name, arguments, call_id)
        if whole is not None or not self.known(name):
            return whole
        return _made(name, arguments.lstrip(), call_id, complete=False)
