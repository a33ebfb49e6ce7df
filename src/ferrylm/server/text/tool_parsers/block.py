"""The shared machinery of the tag-delimited tool-call formats (GLM-4.5, MiniMax-M2, DeepSeek-V3, Kimi-K2,
Qwen3-Coder): :class:`BlockToolParser` holds the text from a format's opening tag to its closing tag and then turns
the block into calls or, failing that, releases it as text, so text that only mentions a tag is never swallowed and
the result never depends on how the text was split into deltas.

Argument values written as text (the XML-style formats) are typed by the tool's JSON schema (:func:`coerce_value`);
the JSON formats (DeepSeek, Kimi) go through :func:`~ferrylm.server.text.tool_parsers.base.decode_arguments`.

This module must not import torch.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Mapping

from ferrylm.server.text.tool_parsers.base import (Piece, ToolCall, ToolParser, cut_arguments, decode_arguments,
                                                   partial_suffix)


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


def value_text(v: Any) -> str:
    """An argument value as the XML-style templates write it: strings as they are, anything else as JSON."""
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def strip_newline(value: str) -> str:
    """Templates write values on their own line at times: one leading and one trailing newline are layout."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def leading(pattern: re.Pattern, text: str, pos: int = 0) -> tuple[list[re.Match], int]:
    """Consecutive matches of ``pattern`` from ``pos``, and the index after the last (``pos`` when none)."""
    found = []
    while (m := pattern.match(text, pos)) is not None:
        found.append(m)
        pos = m.end()
    return found, pos


def match_all(pattern: re.Pattern, text: str, pos: int = 0, end: str = "") -> tuple[list[re.Match], int] | None:
    """Consecutive matches of ``pattern`` from ``pos`` (the pattern takes its own leading blanks), then optional
    blanks and ``end`` (``""``: the end of ``text``). Returns the matches and the index after ``end``, or None
    when something else follows."""
    found, pos = leading(pattern, text, pos)
    rest = len(text) - len(text[pos:].lstrip())
    if end:
        if not text.startswith(end, rest):
            return None
        return found, rest + len(end)
    return (found, rest) if rest == len(text) else None


def strip_tail(text: str, tail: str) -> str:
    """``text`` without ``tail`` at its end, or the start of ``tail`` it was cut in."""
    if text.endswith(tail):
        return text[:-len(tail)]
    return text[:len(text) - partial_suffix(text, tail)]


def unfence(text: str) -> str:
    """``text`` without a surrounding Markdown code fence (```` ```json ... ``` ````), stripped."""
    s = text.strip()
    if s.startswith("```") and s.endswith("```") and len(s) >= 6:
        s = s[3:-3]
        first, nl, rest = s.partition("\n")
        if nl and re.fullmatch(r"[A-Za-z]*", first.strip()):
            s = rest
    return s.strip()


def object_args(calls: list[tuple[Any, Any, Any]]) -> list[tuple[Any, dict, Any]]:
    """Earlier calls ``(name, arguments, id)`` with arguments that are not an object as ``{"arguments": value}``."""
    return [(name, args if isinstance(args, dict) else {"arguments": args}, cid) for name, args, cid in calls]


class BlockToolParser(ToolParser):
    """Shared loop of the tag-delimited formats: text outside ``OPEN`` … ``CLOSE`` is content; a block is held
    until its ``CLOSE`` and then becomes calls (:meth:`parse_block`) or, failing that, text. Whitespace next to a
    call is not content (the blank runs before, between and after calls are dropped), as in Hermes.

    ``LEAD``: when set, the tag a block body must start with (after blanks); a body that cannot start with it ends
    the block at once (the ``OPEN`` was a mention), see :meth:`viable`. ``EXTRA_BLOCKS``: other ``(open, close)``
    pairs a block may be written with (a tag a model drops at times); the hooks see the pair of the block at hand
    in ``self._open`` / ``self._close``. No opening tag may hold another past its first character (then the first
    opening tag in the text is certain as soon as it is whole).

    Args:
        tool_names: the request's tools; a call naming another function leaves its block as text. None: any name.
        schemas: ``name -> parameters`` JSON schema, for :func:`coerce_value` (absent tools: values read as JSON).
    """

    OPEN = ""
    CLOSE = ""
    LEAD = ""
    EXTRA_BLOCKS: tuple[tuple[str, str], ...] = ()

    def __init__(self, tool_names: Iterable[str] | None = None, schemas: Mapping[str, dict] | None = None):
        self.names = None if tool_names is None else frozenset(tool_names)
        self.schemas = dict(schemas or {})
        self.calls = 0
        self._buf = ""
        self._in_block = False
        self._ws = ""
        self._after_call = False
        self._raw_close = False   # finish(): a body close_at never ends (a value never closed) ends at the first CLOSE
        self._open, self._close = self.OPEN, self.CLOSE   # the tags of the block at hand
        self._pairs = ((self.OPEN, self.CLOSE), *self.EXTRA_BLOCKS)

    # -- format hooks -------------------------------------------------------------------------------------
    def viable(self, body: str) -> bool:
        """False once the text after ``OPEN`` can no longer be a block (then ``OPEN`` was a mention). Must be
        monotone: a False body stays False whatever follows (chunking invariance). Default: the body (after
        blanks) starts with ``LEAD`` or could still; any body when there is no ``LEAD`` (or the block is one of
        ``EXTRA_BLOCKS``)."""
        if not self.LEAD or self._open != self.OPEN:
            return True
        s = body.lstrip()
        return s.startswith(self.LEAD) or self.LEAD.startswith(s)

    def parse_block(self, body: str) -> list[ToolCall] | None:
        """The calls of a whole block body, or None when it is not a well-formed block of known tools."""
        raise NotImplementedError

    def cut_calls(self, body: str) -> list[ToolCall]:
        """The calls of an open block the output ended in (see :meth:`ToolParser.cut_block`)."""
        raise NotImplementedError

    def cut_block(self, body: str) -> list[ToolCall]:
        """A block whose closing tag had begun (a start no other tag of ``MARKUP`` shares) is whole
        (:meth:`parse_block`); else :meth:`cut_calls`."""
        head = strip_tail(body, self._close)
        tail = body[len(head):]
        if tail and not any(t != self._close and t.startswith(tail) for t in self.MARKUP):
            calls = self.parse_block(head)
            if calls:
                return calls
        return self.cut_calls(body)

    def close_at(self, buf: str) -> int:
        """Index of the closing tag that ends the block whose body starts ``buf`` (-1: not seen yet). Default: the
        first one. A format whose values may hold the tag overrides it; the answer for a prefix of ``buf`` must
        hold for ``buf`` (a left-to-right scan), so that chunking does not change it."""
        return buf.find(self._close)

    # -- the loop (HermesToolParser's rules) -------------------------------------------------------------
    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while True:
            if self._in_block:
                j = self._buf.find(self._close) if self._raw_close else self.close_at(self._buf)
                body = self._buf if j < 0 else self._buf[:j]
                if not self.viable(body):
                    self._in_block = False
                    self._text(self._open, out)
                    continue
                if j < 0:
                    return out
                self._buf = self._buf[j + len(self._close):]
                self._in_block = False
                calls = self.parse_block(body)
                if not calls:
                    self._text(self._open + body + self._close, out)
                else:
                    self._ws = ""
                    self._after_call = True
                    self.calls += len(calls)
                    out.extend(Piece(call=c) for c in calls)
                continue
            found = [(i, -len(o), o, c) for o, c in self._pairs if (i := self._buf.find(o)) >= 0]
            if found:
                i, _, self._open, self._close = min(found)
                self._text(self._buf[:i], out)
                self._buf = self._buf[i + len(self._open):]
                self._in_block = True
                continue
            keep = max(partial_suffix(self._buf, o) for o, _ in self._pairs)
            self._text(self._buf[:len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep:]
            return out

    def finish(self) -> list[Piece]:
        out = self.feed("")
        if self._in_block and self._close in self._buf:   # a malformed body (a value never closed): the first tag
            self._raw_close = True
            out += self.feed("")
        rest = (self._open if self._in_block else "") + self._buf
        self._buf, self._in_block = "", False
        self._text(rest, out)
        if self._ws and not self.calls:
            out.append(Piece(self._ws))
        self._ws = ""
        return out

    def _text(self, text: str, out: list[Piece]) -> None:
        if not text:
            return
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if body:
            out.append(Piece(self._ws + body))
            self._ws = ""
        self._ws += text[len(body):]

    # -- helpers for parse_block -----------------------------------------------------------------------------
    def known(self, name: str) -> bool:
        """Whether ``name`` is one of the request's tools (any name when the parser was given None)."""
        return bool(name) and (self.names is None or name in self.names)

    def _call(self, name: str, pairs: list[tuple[str, str]]) -> ToolCall | None:
        """A call of ``name`` with the raw ``(key, value text)`` pairs, or None for an unknown tool or a key given
        twice."""
        if not self.known(name):
            return None
        props = (self.schemas.get(name) or {}).get("properties") or {}
        args: dict[str, Any] = {}
        for key, value in pairs:
            if key in args:
                return None
            args[key] = coerce_value(value, props.get(key))
        return ToolCall(name, json.dumps(args, ensure_ascii=False))

    def _cut_call(self, name: str, pairs: list[tuple[str, str]]) -> ToolCall | None:
        """The unfinished call of ``name`` with the whole ``(key, value text)`` pairs so far (None for an unknown
        tool): its arguments the JSON text of those values (:func:`cut_arguments`)."""
        if not self.known(name):
            return None
        props = (self.schemas.get(name) or {}).get("properties") or {}
        return ToolCall(name, cut_arguments({k: coerce_value(v, props.get(k)) for k, v in pairs}), complete=False)

    def _json_cut(self, name: str, arguments: str, call_id: str | None = None) -> ToolCall | None:
        """The call of ``name`` the output ended in, its arguments the JSON text so far: whole when that text is
        a whole object already (:meth:`_json_call`), else unfinished; None for an unknown tool."""
        whole = self._json_call(name, arguments, call_id)
        if whole is not None or not self.known(name):
            return whole
        text = arguments.lstrip()
        if call_id is None:
            return ToolCall(name, text, complete=False)
        return ToolCall(name, text, call_id, complete=False)

    def _json_call(self, name: str, arguments: str, call_id: str | None = None) -> ToolCall | None:
        """A call of ``name`` whose arguments are JSON text of an object (or a JSON string holding one), or None
        for an unknown tool or other arguments. ``call_id``: the id the model gave the call (else a fresh one)."""
        if not self.known(name):
            return None
        try:
            args = decode_arguments(json.loads(arguments))
        except (ValueError, RecursionError):
            return None
        if args is None:
            return None
        text = json.dumps(args, ensure_ascii=False)
        return ToolCall(name, text) if call_id is None else ToolCall(name, text, call_id)
