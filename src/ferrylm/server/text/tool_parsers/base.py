"""What every tool-call parser provides, and what they share: a parser is fed the assistant's text incrementally
and returns what is now certain, text and complete calls (:class:`Piece`).

A call is reported once its closing tag is seen and its body has the format's shape, naming one of the request's
tools with object arguments; anything else goes out as ordinary text, so text that only mentions a tag is never
swallowed. Decisions depend only on the text, never on how it was split, so a stream and a non-stream response
carry the same calls and text. The one exception is the end of an output a grammar forced to be calls
(:meth:`ToolParser.finish_forced`): there the block still open is the call the output was cut in, released as an
unfinished call, never as text. Nothing here imports torch.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping


@dataclass
class ToolCall:
    """A parsed call; ``arguments`` is JSON text of an object. ``complete`` False: the output ended inside the call
    (``max_tokens``), ``arguments`` is the JSON text generated so far (a prefix of an object, or ``""``)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    complete: bool = True

    def arguments_object(self) -> dict:
        """The arguments as an object; an unfinished call's hold the values its JSON prefix completed (a string
        cut inside is left out), as the ``openai`` / ``anthropic`` SDKs read partial arguments."""
        if self.complete:
            return json.loads(self.arguments)
        from pydantic_core import from_json

        try:
            value = from_json(self.arguments, allow_partial=True) if self.arguments.strip() else {}
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


@dataclass
class Piece:
    """What a parser releases: ``text`` (ordinary content; reasoning when ``reasoning``) or a ``call``. A call whose
    arguments are streamed comes as its ``head`` (id and name, ``arguments`` ""), then pieces of ``args`` (the next
    text of its arguments), then the call itself (the head's id; its ``arguments`` the ``args`` joined)."""

    text: str = ""
    call: ToolCall | None = None
    reasoning: bool = False
    head: ToolCall | None = None
    args: str = ""


class ToolParser:
    """Interface: ``feed(text)`` → pieces now certain; ``finish()`` → the rest at the end of the output (a block
    never closed is text); ``finish_forced()`` → the rest at the end of an output a grammar forced to be calls;
    ``finish_cut()`` → the rest at the end of an output ``max_tokens`` cut.
    ``calls`` counts the calls released so far. A parser holds the text of an open block (after its opening tag)
    in ``_buf`` while ``_in_block``.

    Per format (class attributes): ``MARKUP``, the tags its calls are written with (when the vocabulary has them
    as *special* tokens a chat turn is detokenized with ``skip_special_tokens`` off, or they would vanish before
    the parser sees them); ``TEMPLATE_MARK``, a regular expression a chat template that writes this format
    matches; ``ONE_SECTION``, whether a turn's calls are written as one section (else one block per call);
    :meth:`render_calls`, earlier calls written back in the format.
    """

    MARKUP: tuple[str, ...] = ()
    TEMPLATE_MARK = ""
    ONE_SECTION = False
    calls: int = 0
    _buf: str = ""
    _in_block: bool = False

    def __init__(self, tool_names: Iterable[str] | None = None, schemas: Mapping[str, dict] | None = None):
        raise NotImplementedError

    @classmethod
    def render_calls(cls, calls: list[tuple[Any, Any, Any]]) -> str:
        """Earlier calls ``(name, arguments, id)`` of one assistant turn as this format's markup, the text its
        parser reads back."""
        raise NotImplementedError

    def feed(self, text: str) -> list[Piece]:
        raise NotImplementedError

    def finish(self) -> list[Piece]:
        raise NotImplementedError

    def finish_forced(self) -> list[Piece]:
        """The end of an output a grammar forced to be calls (``tool_choice`` required or named): the block still
        open is the call the output was cut in (``max_tokens``, a stop string), so it becomes the calls of
        :meth:`cut_block`, never text; a tag cut short is dropped."""
        out = self.feed("")
        body = self._buf if self._in_block else ""
        self._buf, self._in_block = "", False
        calls = self.cut_block(body) if body else []
        self.calls += len(calls)
        return out + [Piece(call=c) for c in calls]

    def finish_cut(self) -> list[Piece]:
        """The end of an output ``max_tokens`` cut that no grammar forced: after a whole call (released already, or
        whole in the block still open) the block it ended in is read as :meth:`finish_forced` reads it (calls,
        never text: the turn drops its unfinished call); before any, as :meth:`finish`."""
        out = self.feed("")
        body = self._buf if self._in_block else ""
        whole = bool(body) and any(c.complete for c in self.cut_block(body))
        return out + (self.finish_forced() if self.calls or whole else self.finish())

    def cut_block(self, body: str) -> list[ToolCall]:
        """The calls of a block the output ended in (``body``: the text after its opening tag): the whole calls it
        holds, then the unfinished one (``complete=False``, arguments as JSON text so far) once its name is
        whole and one of the request's tools; none when the name is not."""
        raise NotImplementedError


def partial_suffix(buf: str, tag: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:k]):
            return k
    return 0


def cut_arguments(pairs: dict) -> str:
    """The JSON text of an unfinished call whose arguments are ``pairs`` so far (the XML-style formats): the
    object without its closing brace, a prefix of the whole call's arguments."""
    return json.dumps(pairs, ensure_ascii=False)[:-1]


def decode_arguments(value: Any) -> dict | None:
    """A call's arguments as an object: ``value`` itself when it is one, the object a JSON string holds (models
    and templates that encode the arguments twice), else None."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):   # a model may nest past the recursion limit
            return None
    return value if isinstance(value, dict) else None


def call_fields(call: Any) -> tuple[Any, Any]:
    """``(name, arguments)`` of an earlier call (OpenAI ``tool_calls`` entry), arguments decoded from JSON text when
    they are (else left as given)."""
    fn = call.get("function", call) if isinstance(call, dict) else {}
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return fn.get("name"), args


def call_items(calls: list[Any]) -> list[tuple[Any, Any, Any]]:
    """``(name, arguments, id)`` of earlier calls (OpenAI ``tool_calls`` entries), arguments as
    :func:`call_fields` reads them."""
    return [(*call_fields(c), c.get("id") if isinstance(c, dict) else None) for c in calls]
