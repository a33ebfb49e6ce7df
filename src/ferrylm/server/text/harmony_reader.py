"""Harmony output read by channel, token by token, with the ``openai-harmony`` library's ``StreamableParser``.

Two stages share one token reading (:class:`HarmonyTokens`: tokens → :class:`Segment` s, the text of each message
with its channel and recipient, and where messages open and close):

- :class:`HarmonyTextStream`, a choice's text pipeline (a :class:`~ferrylm.server.text.text_stream.TextPipeline`
  like the plain ``TextStream``, for harmony chat turns): its text is the messages' text without their headers, and
  stop strings are looked for inside one message at a time (never in a header, never across two messages). A stop
  string ends the output as for any model: the text is cut before it (after it with ``include_stop_str_in_output``).
- :class:`HarmonyReader`, the turn's output reader: the pieces of the segments, released only as far as the text
  stream released text (its ``text`` argument), so a stop string cuts the pieces at the same character and text
  that may still turn out to be a stop string is held in both.

What the segments become:

- ``analysis`` → reasoning, as it comes.
- a message to ``functions.NAME`` (``commentary``, ``<|constrain|>json``) → one complete tool call when the message
  ends (``<|call|>``), if NAME is one of the request's tools and the arguments are a JSON object; else its text is
  content (as the other formats do with a call they cannot read). A call to a request tool that the output ended
  in (``max_tokens``, a stop string) is an unfinished call (``ToolCall.complete`` False) with the arguments so far.
- ``final``, and ``commentary`` without a recipient (a preamble) → content, as it comes.
- Output that never opens a message (no ``<|message|>``; a model not following the format) is content at the end,
  unless it began a channel header; output after a token the parser refuses is content, special tokens left out.
  The client sees every generated token that is text.

Reasoning tokens (``usage``): the tokens that leave the parser inside an ``analysis`` message, and the one that
closes it. Both stages are primed with the prompt's open message (``harmony.open_message``: ``<|start|>assistant``,
or a continued assistant message, so its text goes on in the same channel). Decisions depend only on the tokens,
one at a time, so a stream and a whole reply give the same parts. This module must not import torch.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
from dataclasses import dataclass
from typing import Literal, Sequence

import openai_harmony as oh

from ferrylm.server.text.harmony import CHANNEL, TOOL_NAMESPACE, HarmonyCodec
from ferrylm.server.text.text_stream import TextPipeline
from ferrylm.server.text.tool_parsers.base import Piece, ToolCall, decode_arguments

ANALYSIS = "analysis"


@dataclass(frozen=True)
class Segment:
    """One step of harmony output: a message ``open`` ed (with its ``channel`` and ``recipient``), ``text`` of the
    open message (``channel`` None: text outside the format), or the message's ``end``."""

    kind: Literal["open", "text", "end"]
    text: str = ""
    channel: str | None = None
    recipient: str | None = None


class HarmonyTokens:
    """A choice's harmony tokens → :class:`Segment` s (module docstring). ``text``: all message text so far;
    ``reasoning_tokens``: the tokens read inside an ``analysis`` message so far (and those that closed one).

    Args:
        codec: the served harmony codec (its encoding, and token bytes for text outside the format).
        prime: the prompt's open message (:func:`ferrylm.server.text.harmony.open_message`).
    """

    def __init__(self, codec: HarmonyCodec, prime: Sequence[int]):
        self.codec = codec
        self.parser = oh.StreamableParser(codec.encoding, None, strict=False)
        for t in prime:
            self.parser.process(t)
        self.text = ""
        self.reasoning_tokens = 0
        self._in_message = self.parser.current_role is not None
        self._channel = self.parser.current_channel
        self._started = self._in_message   # a message was opened (so text outside one is a cut header)
        self._loose: list[int] = []        # tokens before any message opened
        self._raw: codecs.IncrementalDecoder | None = None   # set when the parser refused a token

    @property
    def open_message(self) -> tuple[str | None, str | None] | None:
        """``(channel, recipient)`` of the message the prime left open, None when it left none (read before the
        first :meth:`feed`)."""
        if not self._in_message:
            return None
        return self.parser.current_channel, self.parser.current_recipient

    def feed(self, token_ids: Sequence[int]) -> list[Segment]:
        out: list[Segment] = []
        for t in token_ids:
            if self._raw is not None:
                self._raw_text([t], out)
            else:
                self._token(int(t), out)
        return out

    def finish(self) -> list[Segment]:
        """What is left at the end: undecoded bytes, or output that never opened a message (unless it began a
        channel header)."""
        out: list[Segment] = []
        if self._raw is None and not self._started and self._loose and CHANNEL not in self._loose:
            self._raw = codecs.getincrementaldecoder("utf-8")(errors="replace")
            self._raw_text(self._loose, out)
        if self._raw is not None:
            self._add(self._raw.decode(b"", final=True), None, None, out)
        return out

    def _token(self, t: int, out: list[Segment]) -> None:
        if not self._started:
            self._loose.append(t)
        was_analysis = self._in_message and self._channel == ANALYSIS
        try:
            self.parser.process(t)
        except oh.HarmonyError:
            self._raw = codecs.getincrementaldecoder("utf-8")(errors="replace")
            self._raw_text([t] if self._started else self._loose, out)
            return
        in_message = self.parser.current_role is not None
        channel, recipient = self.parser.current_channel, self.parser.current_recipient
        if self._in_message and not in_message:
            out.append(Segment("end"))
        if in_message and not self._in_message:
            self._started = True
            out.append(Segment("open", channel=channel, recipient=recipient))
        if in_message:
            self._add(self.parser.last_content_delta or "", channel, recipient, out)
        self._in_message, self._channel = in_message, channel if in_message else None
        if was_analysis or (in_message and channel == ANALYSIS):
            self.reasoning_tokens += 1

    def _add(self, text: str, channel: str | None, recipient: str | None, out: list[Segment]) -> None:
        if text:
            self.text += text
            out.append(Segment("text", text, channel, recipient))

    def _raw_text(self, ids: Sequence[int], out: list[Segment]) -> None:
        assert self._raw is not None
        enc = self.codec.encoding
        data = b"".join(self.codec.token_bytes(t) for t in ids if not enc.is_special_token(int(t)))
        self._add(self._raw.decode(data), None, None, out)


class HarmonyTextStream(TextPipeline):
    """A harmony chat turn's text pipeline: the messages' text (no headers), stop strings looked for inside one
    message at a time (module docstring). ``detok.text`` is the messages' text before the stop strings' cut."""

    def __init__(self, codec: HarmonyCodec, prime: Sequence[int], *, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False):
        super().__init__(stop, include_stop_str_in_output)
        self.detok = HarmonyTokens(codec, prime)

    def _step(self, token_id: int) -> str:
        return "".join(self._segment(s) for s in self.detok.feed((token_id,)))

    def _drain(self) -> str:
        return "".join(self._segment(s) for s in self.detok.finish())

    def _segment(self, s: Segment) -> str:
        """The text ``s`` releases: its text through the stop strings; a message's end releases what was held
        (a stop string never spans two messages)."""
        if s.kind == "text":
            return self.stops.feed(s.text)
        return self.stops.flush() if s.kind == "end" else ""


class HarmonyReader:
    """One choice's harmony tokens → pieces (reasoning text, content text, complete calls), in order, released as
    far as the choice's text stream released text (module docstring).

    Args:
        codec: the served harmony codec.
        prime: the prompt's open message (:func:`ferrylm.server.text.harmony.open_message`).
        tool_names: the request's tools; None: no call is read (calls are content).
    """

    def __init__(self, codec: HarmonyCodec, prime: Sequence[int], tool_names: tuple[str, ...] | None):
        self.tokens = HarmonyTokens(codec, prime)
        self.names = None if tool_names is None else frozenset(tool_names)
        opened = self.tokens.open_message
        self._queue: list[Segment] = [] if opened is None else [Segment("open", channel=opened[0],
                                                                        recipient=opened[1])]
        self._budget = 0            # characters of message text the text stream released so far
        self._open: Segment | None = None   # the message at hand (released up to its text), None between messages
        self._args = ""             # the text of the message to a recipient, so far

    @property
    def reasoning_tokens(self) -> int:
        return self.tokens.reasoning_tokens

    def feed(self, text: str, token_ids: Sequence[int]) -> list[Piece]:
        """Pieces certain after ``token_ids``, within the ``text`` the text stream released with them."""
        self._budget += len(text)
        self._queue += self.tokens.feed(token_ids)
        return self._release()

    def finish(self, cut: bool = False) -> list[Piece]:
        """What is left at the end: the call the output ended in (unfinished; its text when it is no call of a
        request tool), output outside the format, undecoded bytes. Segments past the released text (after a stop
        string) are dropped. ``cut`` (``max_tokens`` ended the output) changes nothing: a call ends the turn."""
        self._queue += self.tokens.finish()
        out = self._release()
        self._queue = []
        name = self._tool_name()
        if name is not None:
            out.append(Piece(call=ToolCall(name, self._args, complete=False)))
        elif self._args:
            out.append(Piece(self._args))
        self._args, self._open = "", None
        return out

    def _release(self) -> list[Piece]:
        out: list[Piece] = []
        while self._queue:
            s = self._queue[0]
            if s.kind != "text":
                self._boundary(s, out)
            else:
                n = min(len(s.text), self._budget)
                if n == 0:
                    break
                self._budget -= n
                self._text(s, s.text[:n], out)
                if n < len(s.text):
                    self._queue[0] = dataclasses.replace(s, text=s.text[n:])
                    break
            self._queue.pop(0)
        return out

    def _boundary(self, s: Segment, out: list[Piece]) -> None:
        """A message opened (``open``) or closed (``end``: a recipient's message becomes a call, or content)."""
        if s.kind == "open":
            self._open = s
            return
        name, args = self._tool_name(), decode_arguments(self._args)
        if name is not None and args is not None:
            out.append(Piece(call=ToolCall(name, json.dumps(args, ensure_ascii=False))))
        elif self._args:
            out.append(Piece(self._args))
        self._args, self._open = "", None

    def _text(self, s: Segment, text: str, out: list[Piece]) -> None:
        if s.channel is None:   # outside the format
            out.append(Piece(text))
        elif s.recipient is not None:
            self._args += text
        else:
            out.append(Piece(text, reasoning=s.channel == ANALYSIS))

    def _tool_name(self) -> str | None:
        """The request tool the message at hand is a call to (its recipient ``functions.NAME``), else None."""
        recipient = self._open.recipient if self._open is not None else None
        if recipient is None or self.names is None:
            return None
        name = recipient.removeprefix(f"{TOOL_NAMESPACE}.")
        return name if name != recipient and name in self.names else None
