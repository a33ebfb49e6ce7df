"""Tool-call output formats besides Hermes: GLM-4.5 and MiniMax-M2, behind the :class:`~ferrylm.server.tools.ToolParser`
interface, and the choice of format for a served model (``--tool-call-parser``, vLLM's flag and names).

GLM-4.5 / 4.6 (``glm45``; the format of zai-org's chat template and of vLLM's ``glm45`` parser)::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

MiniMax-M2 (``minimax_m2``; MiniMax's chat template and vLLM's ``minimax_m2`` parser), several calls per block::

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    </minimax:tool_call>

Argument values are text; each becomes a JSON value by the tool's parameter schema (:func:`coerce_value`): a
``string`` property keeps the text, any other type is read as JSON (the templates write non-strings with
``tojson``), and text that is not JSON stays a string. A block becomes calls only once its closing tag is seen and
its whole body has the format's shape, naming tools of the request; anything else is released as ordinary text, so
text that only mentions a tag is never swallowed. Decisions depend on the text only, never on its chunking.

This module must not import torch.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Mapping

from ferrylm.server.tools import HermesToolParser, Piece, ToolCall, ToolParser, _partial_suffix

TOOL_PARSER_NAMES = ("hermes", "glm45", "minimax_m2")
TOOL_PARSER_CHOICES = ("auto", *TOOL_PARSER_NAMES)
_ARCH_PARSERS = {"Glm4MoeForCausalLM": "glm45", "MiniMaxM2ForCausalLM": "minimax_m2"}


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
    except ValueError:
        return text


class BlockToolParser(ToolParser):
    """Shared loop of the tag-delimited formats: text outside ``OPEN`` … ``CLOSE`` is content; a block is held
    until its ``CLOSE`` and then becomes calls (:meth:`parse_block`) or, failing that, text. Whitespace next to a
    call is not content (the blank runs before, between and after calls are dropped), as in Hermes.

    Args:
        tool_names: the request's tools; a call naming another function leaves its block as text. None: any name.
        schemas: ``name -> parameters`` JSON schema, for :func:`coerce_value` (absent tools: values read as JSON).
    """

    OPEN = ""
    CLOSE = ""

    def __init__(self, tool_names: Iterable[str] | None = None, schemas: Mapping[str, dict] | None = None):
        self.names = None if tool_names is None else frozenset(tool_names)
        self.schemas = dict(schemas or {})
        self.calls = 0
        self._buf = ""
        self._in_block = False
        self._ws = ""
        self._after_call = False

    # -- format hooks -------------------------------------------------------------------------------------
    def viable(self, body: str) -> bool:
        """False once the text after ``OPEN`` can no longer be a block (then ``OPEN`` was a mention). Must be
        monotone: a False body stays False whatever follows (chunking invariance)."""
        return True

    def parse_block(self, body: str) -> list[ToolCall] | None:
        """The calls of a whole block body, or None when it is not a well-formed block of known tools."""
        raise NotImplementedError

    # -- the loop (HermesToolParser's rules) -------------------------------------------------------------
    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while True:
            if self._in_block:
                j = self._buf.find(self.CLOSE)
                body = self._buf if j < 0 else self._buf[:j]
                if not self.viable(body):
                    self._in_block = False
                    self._text(self.OPEN, out)
                    continue
                if j < 0:
                    return out
                self._buf = self._buf[j + len(self.CLOSE):]
                self._in_block = False
                calls = self.parse_block(body)
                if not calls:
                    self._text(self.OPEN + body + self.CLOSE, out)
                else:
                    self._ws = ""
                    self._after_call = True
                    self.calls += len(calls)
                    out.extend(Piece(call=c) for c in calls)
                continue
            i = self._buf.find(self.OPEN)
            if i >= 0:
                self._text(self._buf[:i], out)
                self._buf = self._buf[i + len(self.OPEN):]
                self._in_block = True
                continue
            keep = _partial_suffix(self._buf, self.OPEN)
            self._text(self._buf[:len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep:]
            return out

    def finish(self) -> list[Piece]:
        out = self.feed("")
        rest = (self.OPEN if self._in_block else "") + self._buf
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

    def _call(self, name: str, pairs: list[tuple[str, str]]) -> ToolCall | None:
        """A call of ``name`` with the raw ``(key, value text)`` pairs, or None for an unknown tool or a key given
        twice."""
        if self.names is not None and name not in self.names:
            return None
        props = (self.schemas.get(name) or {}).get("properties") or {}
        args: dict[str, Any] = {}
        for key, value in pairs:
            if key in args:
                return None
            args[key] = coerce_value(value, props.get(key))
        return ToolCall(name, json.dumps(args, ensure_ascii=False))


_GLM_NAME = re.compile(r"[A-Za-z0-9_.\-]*")
_GLM_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class Glm45ToolParser(BlockToolParser):
    """GLM-4.5 ``<tool_call>name`` + ``<arg_key>`` / ``<arg_value>`` pairs (module docstring); one call a block."""

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def viable(self, body: str) -> bool:
        """The body starts with a function name that ends at a newline or a tag."""
        end = _GLM_NAME.match(body).end()
        return end == len(body) or body[end] in "\n<"

    def parse_block(self, body: str) -> list[ToolCall] | None:
        name_end = _GLM_NAME.match(body).end()
        name, rest = body[:name_end], body[name_end:]
        if not name:
            return None
        pairs, pos = [], 0
        while True:
            m = _GLM_PAIR.match(rest, pos)
            if m is None:
                break
            pairs.append((m[1].strip(), m[2]))
            pos = m.end()
        if rest[pos:].strip():
            return None
        call = self._call(name, pairs)
        return None if call is None else [call]


_MM_INVOKE = re.compile(r"\s*<invoke name=(\"[^\"<>]*\"|'[^'<>]*'|[^\s<>]+)>(.*?)</invoke>", re.S)
_MM_PARAM = re.compile(r"\s*<parameter name=(\"[^\"<>]*\"|'[^'<>]*'|[^\s<>]+)>(.*?)</parameter>", re.S)


def _unquote(s: str) -> str:
    return s[1:-1] if len(s) >= 2 and s[0] == s[-1] and s[0] in "\"'" else s


def _strip_newline(value: str) -> str:
    """The template writes values on their own line at times: one leading and one trailing newline are layout."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


class MiniMaxM2ToolParser(BlockToolParser):
    """MiniMax-M2 ``<minimax:tool_call>`` blocks of ``<invoke name=...>`` calls with ``<parameter name=...>``
    values (module docstring)."""

    OPEN = "<minimax:tool_call>"
    CLOSE = "</minimax:tool_call>"
    _INVOKE = "<invoke"

    def viable(self, body: str) -> bool:
        """The body (after blanks) starts with ``<invoke``, or could still."""
        s = body.lstrip()
        return s.startswith(self._INVOKE) or self._INVOKE.startswith(s)

    def parse_block(self, body: str) -> list[ToolCall] | None:
        calls, pos = [], 0
        while True:
            m = _MM_INVOKE.match(body, pos)
            if m is None:
                break
            inner, pairs, ipos = m[2], [], 0
            while True:
                p = _MM_PARAM.match(inner, ipos)
                if p is None:
                    break
                pairs.append((_unquote(p[1]), _strip_newline(p[2])))
                ipos = p.end()
            if inner[ipos:].strip():
                return None
            call = self._call(_unquote(m[1]), pairs)
            if call is None:
                return None
            calls.append(call)
            pos = m.end()
        if not calls or body[pos:].strip():
            return None
        return calls


#: the tags each format's calls are written with (when the vocabulary has them as *special* tokens, a chat turn
#: is detokenized with ``skip_special_tokens`` off, or they would vanish before the parser sees them)
FORMAT_MARKUP: dict[str, tuple[str, ...]] = {
    "hermes": (HermesToolParser.OPEN, HermesToolParser.CLOSE),
    "glm45": ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    "minimax_m2": ("<minimax:tool_call>", "</minimax:tool_call>"),
}

def _value_text(v: Any) -> str:
    """An argument value as the templates write it: strings as they are, anything else as JSON."""
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def format_call_as(fmt: str, call: Any) -> str:
    """One earlier call (OpenAI ``tool_calls`` entry) as a block of format ``fmt`` (``glm45`` | ``minimax_m2``), the
    markup the format's parser reads back (arguments that are not an object become one ``arguments`` value)."""
    from ferrylm.server.tools import call_fields

    name, args = call_fields(call)
    pairs = list(args.items()) if isinstance(args, dict) else [("arguments", args)]
    if fmt == "glm45":
        return f"<tool_call>{name}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{_value_text(v)}</arg_value>\n"
                                                for k, v in pairs) + "</tool_call>"
    if fmt == "minimax_m2":
        params = "".join(f'<parameter name="{k}">{_value_text(v)}</parameter>\n' for k, v in pairs)
        return f'<minimax:tool_call>\n<invoke name="{name}">\n{params}</invoke>\n</minimax:tool_call>'
    raise ValueError(f"no call rendering for format {fmt!r}")


def fallback_footer(fmt: str) -> str:
    """The call-format instructions of the fallback tools section (``tools.fallback_messages``) for ``fmt``."""
    example = format_call_as(fmt, {"name": "<function name>", "arguments": {"<parameter>": "<value>"}})
    return ("\n</tools>\n\nTo call a function, answer with one block per call, each of the form\n" + example +
            "\nwith one parameter entry per argument (strings as they are, other values as JSON).")


PARSER_CLASSES: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "glm45": Glm45ToolParser,
                                               "minimax_m2": MiniMaxM2ToolParser}


def make_tool_parser(name: str, tool_names: Iterable[str] | None,
                     schemas: Mapping[str, dict] | None = None) -> ToolParser:
    """A fresh parser of format ``name`` (:data:`TOOL_PARSER_NAMES`). Raises ValueError for an unknown name."""
    if name == "hermes":
        return HermesToolParser(tool_names)
    cls = PARSER_CLASSES.get(name)
    if cls is None:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from {', '.join(TOOL_PARSER_CHOICES)}")
    return cls(tool_names, schemas)


def choose_tool_parser(flag: str | None, architecture: str | None = None, chat_template: Any = None) -> str:
    """The tool-call format of a served model: ``flag`` (``--tool-call-parser``) unless it is ``auto`` / None;
    then the chat template's own markup (``<minimax:tool_call>`` → ``minimax_m2``, ``<arg_key>`` → ``glm45``), then
    the architecture (``MiniMaxM2ForCausalLM``, ``Glm4MoeForCausalLM``), else ``hermes``.

    Raises:
        ValueError: ``flag`` is not one of :data:`TOOL_PARSER_CHOICES`.
    """
    if flag not in (None, *TOOL_PARSER_CHOICES):
        raise ValueError(f"unknown tool-call parser {flag!r}; choose from {', '.join(TOOL_PARSER_CHOICES)}")
    if flag not in (None, "auto"):
        return flag
    texts = list(chat_template.values()) if isinstance(chat_template, dict) else [chat_template]
    for t in texts:
        if isinstance(t, str) and MiniMaxM2ToolParser.OPEN in t:
            return "minimax_m2"
        if isinstance(t, str) and "<arg_key>" in t:
            return "glm45"
    return _ARCH_PARSERS.get(architecture or "", "hermes")
