"""The shared machinery of the tag-delimited tool-call formats (Hermes, GLM-4.5, MiniMax-M2, DeepSeek-V3 / V3.2 / V4,
Kimi-K2, Qwen3-Coder): :class:`BlockToolParser` holds the text from a format's opening tag to its closing tag and
then turns the block into calls or, failing that, releases it as text, so text that only mentions a tag is never
swallowed and the result never depends on how the text was split into deltas. :class:`CallListParser` is the block
of the formats that list a turn's calls in one block (DeepSeek, Kimi), :class:`InvokeListParser` those whose calls
are invokes of named parameters (MiniMax-M2, DSML): a format gives its patterns and reads one call's parts.

The calls themselves are assembled by :class:`~ferrylm.server.text.tool_parsers.calls.RequestTools` (``self.tools``).

This module must not import torch.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Mapping

from ferrylm.server.text.tool_parsers.base import Piece, ToolCall, ToolParser, partial_suffix
from ferrylm.server.text.tool_parsers.calls import RequestTools
from ferrylm.server.text.tool_parsers.json_prefix import StreamedCall


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
    until its ``CLOSE`` and then becomes calls (:meth:`parse_block`) or, failing that, text; unless the format
    streams it (:meth:`stream_head`): then the block is that call from its head on, its arguments released as they
    are written, and it ends at ``CLOSE`` or at the end of the output. Whitespace next to a call is not content (the
    blank runs before, between and after calls are dropped).

    ``LEAD``: when set, the tag a block body must start with (after blanks); a body that cannot start with it ends
    the block at once (the ``OPEN`` was a mention), see :meth:`viable`. ``EXTRA_BLOCKS``: other ``(open, close)``
    pairs a block may be written with (a tag a model drops at times); the hooks see the pair of the block at hand
    in ``self._open`` / ``self._close``. No opening tag may hold another past its first character (then the first
    opening tag in the text is certain as soon as it is whole).

    Args:
        tool_names: the request's tools; a call naming another function leaves its block as text. None: any name.
        schemas: ``name -> parameters`` JSON schema, for typing values (``self.tools``, :class:`RequestTools`).
    """

    OPEN = ""
    CLOSE = ""
    LEAD = ""
    EXTRA_BLOCKS: tuple[tuple[str, str], ...] = ()

    def __init__(self, tool_names: Iterable[str] | None = None, schemas: Mapping[str, dict] | None = None):
        self.tools = RequestTools(tool_names, schemas)
        self.calls = 0
        self.blocks = 0   # blocks opened so far (the one at hand is number ``blocks``)
        self._buf = ""
        self._in_block = False
        self._ws = ""
        self._after_call = False
        self._raw_close = False   # finish(): a body close_at never ends (a value never closed) ends at the first CLOSE
        self._open, self._close = self.OPEN, self.CLOSE   # the tags of the block at hand
        self._streamed: StreamedCall | None = None   # the block at hand is this call, its arguments streamed
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

    def stream_head(self, body: str) -> StreamedCall | None:
        """The call whose arguments are streamed, once ``body`` (the open block's text so far) shows its head; None
        while it does not (default: never, the block is held to its closing tag). Must hold for every longer body
        once it holds for one (chunking invariance)."""
        return None

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

    # -- the loop ----------------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while True:
            if self._in_block:
                j = self._buf.find(self._close) if self._raw_close else self.close_at(self._buf)
                body = self._buf if j < 0 else self._buf[:j]
                if self._streamed is None and not self.viable(body):
                    self._in_block = False
                    self._text(self._open, out)
                    continue
                out += self._stream(body)
                if j < 0:
                    return out
                self._buf = self._buf[j + len(self._close):]
                self._in_block = False
                calls = self.parse_block(body) if self._streamed is None else [self._streamed.call(body)]
                self._streamed = None
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
                self.blocks += 1
                continue
            keep = max(partial_suffix(self._buf, o) for o, _ in self._pairs)
            self._text(self._buf[:len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep:]
            return out

    def _stream(self, body: str) -> list[Piece]:
        """The head and the new arguments text of the block's streamed call (none for a block held whole)."""
        out = []
        if self._streamed is None:
            self._streamed = self.stream_head(body)
            if self._streamed is None:
                return []
            out.append(Piece(head=self._streamed.head))
        args = self._streamed.more(body)
        return (out + [Piece(args=args)]) if args else out

    def _end_stream(self) -> list[Piece]:
        """At the end of the output: the streamed calls of the blocks it ended in, each as far as it was released;
        a closing tag after that (held in a string never closed) ends its block, and what follows is read on."""
        out: list[Piece] = []
        while self._streamed is not None:
            sc, self._streamed, self._in_block = self._streamed, None, False
            out.append(Piece(call=sc.call(self._buf)))
            self.calls += 1
            self._ws, self._after_call = "", True
            j = self._buf.find(self._close, sc.start + sc.sent)
            self._buf = self._buf[j + len(self._close):] if j >= 0 else ""
            out += self.feed("")
        return out

    def finish(self) -> list[Piece]:
        out = self.feed("")
        out += self._end_stream()
        if self._in_block and self._close in self._buf:   # a malformed body (a value never closed): the first tag
            self._raw_close = True
            out += self.feed("")
            out += self._end_stream()
        rest = (self._open if self._in_block else "") + self._buf
        self._buf, self._in_block = "", False
        self._text(rest, out)
        if self._ws and not self.calls:
            out.append(Piece(self._ws))
        self._ws = ""
        return out

    def finish_forced(self) -> list[Piece]:
        out = self.feed("")
        out += self._end_stream()
        return out + super().finish_forced()

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


class CallListParser(BlockToolParser):
    """A block listing a turn's calls: whole calls back to back (``CALL`` matches one, its leading blanks
    included), nothing else. The format reads one call (:meth:`whole_call`) and the call an output ended in, from
    ``CUT``'s match after the whole ones (:meth:`open_call`)."""

    CALL: re.Pattern
    CUT: re.Pattern

    def whole_call(self, m: re.Match) -> ToolCall | None:
        """The call ``CALL`` matched, or None when it is not one of the request's tools or malformed."""
        raise NotImplementedError

    def open_call(self, m: re.Match) -> ToolCall | None:
        """The unfinished call whose start ``CUT`` matched (its text runs to the end of ``m.string``), None until
        its name is whole and one of the request's tools."""
        raise NotImplementedError

    def parse_block(self, body: str) -> list[ToolCall] | None:
        found = match_all(self.CALL, body)
        if not found or not found[0]:
            return None
        calls = [self.whole_call(m) for m in found[0]]
        return None if None in calls else calls   # type: ignore[return-value]

    def cut_calls(self, body: str) -> list[ToolCall]:
        """The whole calls, then the one the output ended in (:meth:`open_call`)."""
        found, pos = leading(self.CALL, body)
        calls = [c for m in found if (c := self.whole_call(m)) is not None]
        m = self.CUT.match(body, pos)
        cut = self.open_call(m) if m is not None else None
        return calls + ([cut] if cut is not None else [])


class InvokeListParser(CallListParser):
    """A block of invokes, each a function name and its parameters (``PARAM`` matches one, leading blanks
    included); ``CALL`` holds an invoke's name in group 1 and its body in group 2, ``CUT`` an invoke's head (its
    name in group 1). The format reads a name (:meth:`invoke_name`) and a parameter's key and typed value
    (:meth:`param_key`, :meth:`param_value`)."""

    PARAM: re.Pattern

    def invoke_name(self, written: str) -> str:
        """The function name as written in the invoke's head."""
        return written

    def param_key(self, p: re.Match) -> str:
        raise NotImplementedError

    def param_value(self, p: re.Match, schema: Any) -> Any:
        """The value of parameter ``p``, typed by its property ``schema`` (None: not in the schema)."""
        raise NotImplementedError

    def _arguments(self, name: str, params: list[re.Match]) -> dict | None:
        return self.tools.arguments(name, [(self.param_key(p), p) for p in params], self.param_value)

    def whole_call(self, m: re.Match) -> ToolCall | None:
        name = self.invoke_name(m[1])
        params = match_all(self.PARAM, m[2])
        return self.tools.call(name, self._arguments(name, params[0])) if params is not None else None

    def open_call(self, m: re.Match) -> ToolCall | None:
        """The invoke the output ended in once its head is whole, with its whole parameters."""
        name = self.invoke_name(m[1])
        return self.tools.cut_call(name, self._arguments(name, leading(self.PARAM, m.string, m.end())[0]))
