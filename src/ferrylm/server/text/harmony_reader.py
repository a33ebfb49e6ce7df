"""Harmony output read by channel, token by token, with the ``openai-harmony`` library's ``StreamableParser``.

- ``analysis`` → reasoning, as it comes.
- a message to ``functions.NAME`` (``commentary``, ``<|constrain|>json``) → one complete tool call when the message
  ends (``<|call|>``), if NAME is one of the request's tools and the arguments are a JSON object; else its text is
  content (as the other formats do with a call they cannot read). A call to a request tool that the output ended
  in (``max_tokens``) is an unfinished call (``ToolCall.complete`` False) with the arguments generated so far.
- ``final``, and ``commentary`` without a recipient (a preamble) → content, as it comes.
- Output that never opens a message (no ``<|message|>``; a model not following the format) is content at the end,
  unless it began a channel header; output after a token the parser refuses is content, special tokens left out.
  The client sees every generated token that is text.

The reader is primed with the prompt's open message (``harmony.open_message``: ``<|start|>assistant``, or a
continued assistant message, so its text goes on in the same channel). Decisions depend only on the tokens, one at
a time, so a stream and a whole reply give the same parts. This module must not import torch.
"""

from __future__ import annotations

import codecs
import json
from typing import Sequence

import openai_harmony as oh

from ferrylm.server.text.harmony import CHANNEL, TOOL_NAMESPACE, HarmonyCodec
from ferrylm.server.text.tool_parsers.base import Piece, ToolCall, decode_arguments


class HarmonyReader:
    """One choice's harmony tokens → pieces (reasoning text, content text, complete calls), in order.

    Args:
        codec: the served harmony codec (its encoding, and token bytes for text outside the format).
        prime: the prompt's open message (:func:`ferrylm.server.text.harmony.open_message`).
        tool_names: the request's tools; None: no call is read (calls are content).
    """

    def __init__(self, codec: HarmonyCodec, prime: Sequence[int], tool_names: tuple[str, ...] | None):
        self.codec = codec
        self.parser = oh.StreamableParser(codec.encoding, None, strict=False)
        for t in prime:
            self.parser.process(t)
        self.names = None if tool_names is None else frozenset(tool_names)
        self._in_message = self.parser.current_role is not None
        self._channel = self.parser.current_channel
        self._recipient = self.parser.current_recipient
        self._args = ""            # the text of the message to a recipient, so far
        self._started = self._in_message   # a message was opened (so text outside one is a cut header)
        self._loose: list[int] = []        # tokens before any message opened
        self._raw: codecs.IncrementalDecoder | None = None   # set when the parser refused a token

    def feed(self, text: str, token_ids: Sequence[int]) -> list[Piece]:
        """Pieces certain after ``token_ids`` (``text`` is not read: the tokens decide)."""
        out: list[Piece] = []
        for t in token_ids:
            if self._raw is not None:
                self._raw_text([t], out)
            else:
                self._token(int(t), out)
        return out

    def finish(self) -> list[Piece]:
        """What is left at the end: the call the output ended in (unfinished; its text when it is no call of a
        request tool), output outside the format, undecoded bytes."""
        out: list[Piece] = []
        if self._raw is not None:
            tail = self._raw.decode(b"", final=True)
            if tail:
                out.append(Piece(tail))
            return out
        name = self._tool_name()
        if name is not None and self._in_message:
            out.append(Piece(call=ToolCall(name, self._args, complete=False)))
        elif self._args:
            out.append(Piece(self._args))
        self._args = ""
        if not self._started and self._loose and CHANNEL not in self._loose:
            self._raw = codecs.getincrementaldecoder("utf-8")(errors="replace")
            self._raw_text(self._loose, out)
            out += self.finish()
        return out

    def _token(self, t: int, out: list[Piece]) -> None:
        if not self._started:
            self._loose.append(t)
        try:
            self.parser.process(t)
        except oh.HarmonyError:
            self._raw = codecs.getincrementaldecoder("utf-8")(errors="replace")
            self._raw_text([t] if self._started else self._loose, out)
            return
        in_message = self.parser.current_role is not None
        if self._in_message and not in_message:
            self._end_message(out)
        if in_message:
            self._started = True
            self._channel, self._recipient = self.parser.current_channel, self.parser.current_recipient
            delta = self.parser.last_content_delta
            if delta:
                if self._recipient is not None:
                    self._args += delta
                else:
                    out.append(Piece(delta, reasoning=self._channel == "analysis"))
        self._in_message = in_message

    def _end_message(self, out: list[Piece]) -> None:
        """A message closed: a recipient's message becomes a call (or content)."""
        name, args = self._tool_name(), decode_arguments(self._args)
        if name is not None and args is not None:
            out.append(Piece(call=ToolCall(name, json.dumps(args, ensure_ascii=False))))
        elif self._args:
            out.append(Piece(self._args))
        self._args, self._channel, self._recipient = "", None, None

    def _tool_name(self) -> str | None:
        """The request tool the message at hand is a call to (its recipient ``functions.NAME``), else None."""
        if self._recipient is None or self.names is None:
            return None
        name = self._recipient.removeprefix(f"{TOOL_NAMESPACE}.")
        return name if name != self._recipient and name in self.names else None

    def _raw_text(self, ids: Sequence[int], out: list[Piece]) -> None:
        assert self._raw is not None
        enc = self.codec.encoding
        data = b"".join(self.codec.token_bytes(t) for t in ids if not enc.is_special_token(int(t)))
        text = self._raw.decode(data)
        if text:
            out.append(Piece(text))
