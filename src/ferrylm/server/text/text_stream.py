"""Text out of token ids, per choice: incremental detokenization and stop strings.

Text-out pipeline per choice (see :class:`TextStream`; :class:`TextPipeline` is what every pipeline shares)::

    token ids ─▶ IncrementalDetokenizer ─▶ StopChecker ─▶ text safe to send

- :class:`IncrementalDetokenizer` never emits half a UTF-8 character and costs O(window) per step.
- :class:`StopChecker` finds stop strings spanning tokens and holds back text that could start one.

The tokenizer itself (encoding, chat templates) is ``tokenizer.py``. This module must not import torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Iterable, Protocol, Sequence

from ferrylm.faults import NO_FAULTS, FaultInjector

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one step at a time.

    Prefix-offset technique: keep two offsets into the token list. ``prefix`` marks the start of a small window of
    already-emitted tokens that give the decoder its context (leading spaces, byte pieces); ``read`` marks the
    first token whose text has not been emitted. Each step decodes ``tokens[prefix:read]`` and
    ``tokens[prefix:]`` and emits the difference, so the cost is O(window), not O(sequence). When the new text
    ends with U+FFFD it is an incomplete UTF-8 sequence: nothing is emitted and the tokens wait for the bytes
    that complete the character. :meth:`flush` emits whatever is left at the end (a genuinely invalid sequence
    then appears as U+FFFD).

    Args:
        decode: ``decode(ids, skip_special_tokens) -> str``.
        prompt_ids: the prompt; its last :attr:`CONTEXT` tokens seed the window (their text is never emitted).
        skip_special_tokens: drop special tokens from the text.
        faults: fault injector (point ``detokenize``: :meth:`step` raises MemoryError when it fires).
    """

    CONTEXT = 5          # prompt tokens used as the initial decode context
    MAX_PENDING = 16     # a held tail longer than this cannot be one incomplete character: emit it anyway
    _TRIM_AT = 1024      # drop emitted tokens before ``prefix`` once this many accumulate

    def __init__(self, decode: Callable[[Sequence[int], bool], str], prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True, faults: FaultInjector = NO_FAULTS):
        self._decode = decode
        self._faults = faults
        self._prompt_len = len(prompt_ids)
        self._skip = skip_special_tokens
        self._tokens: list[int] = list(prompt_ids[-self.CONTEXT:]) if self.CONTEXT else []
        self._prefix = 0
        self._read = len(self._tokens)
        self.text = ""          # all text emitted so far
        self.num_tokens = 0     # generated tokens fed so far

    def step(self, token_ids: Iterable[int]) -> str:
        """Feed new token ids; return the newly complete text ('' when it is held back).

        Raises:
            MemoryError: a host allocation failed (or the ``detokenize`` fault fired); the caller fails only
                this request (503 ``insufficient_memory``).
        """
        if self._faults.enabled:
            self._faults.check_host("detokenize", prompt_tokens=self._prompt_len)
        for t in token_ids:
            self._tokens.append(int(t))
            self.num_tokens += 1
        if self._read >= len(self._tokens):
            return ""
        prefix_text = self._decode(self._tokens[self._prefix:self._read], self._skip)
        new_text = self._decode(self._tokens[self._prefix:], self._skip)
        pending = len(self._tokens) - self._read
        if new_text.endswith(REPLACEMENT_CHAR) and pending <= self.MAX_PENDING:
            return ""
        return self._advance(prefix_text, new_text)

    def flush(self) -> str:
        """Emit the text of every token fed so far, even an incomplete character (call once at the end)."""
        if self._read >= len(self._tokens):
            return ""
        prefix_text = self._decode(self._tokens[self._prefix:self._read], self._skip)
        new_text = self._decode(self._tokens[self._prefix:], self._skip)
        return self._advance(prefix_text, new_text)

    def _advance(self, prefix_text: str, new_text: str) -> str:
        if new_text == prefix_text:  # e.g. a skipped special token: nothing to emit, nothing to wait for
            self._read = len(self._tokens)
            return ""
        if len(new_text) < len(prefix_text):  # the decoder rewrote the context; wait for more tokens
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix = self._read
        self._read = len(self._tokens)
        if self._prefix >= self._TRIM_AT:
            del self._tokens[:self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        self.text += delta
        return delta


class StopChecker:
    """Finds stop strings in streamed text, across token boundaries.

    Text is fed in pieces; :meth:`feed` returns the part that is safe to send. A tail that could be the start of
    a stop string is held back until the next piece decides it. When a stop string is found the output is cut
    before it (or after it with ``include_stop_str_in_output``), :attr:`stopped` becomes True and every later
    piece is ignored; the caller must then abort the engine request. At the end of a request that did not stop,
    :meth:`flush` returns the held tail.
    """

    def __init__(self, stop: Sequence[str] = (), include_stop_str_in_output: bool = False):
        self.stop = [s for s in stop if s]
        self.include = include_stop_str_in_output
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Add ``text``; return what may be sent now."""
        if self.stopped or not text:
            return ""
        if not self.stop:
            return text
        buf = self._held + text
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.stopped, self.matched, self._held = True, s, ""
            return buf[:i + len(s)] if self.include else buf[:i]
        keep = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """Return (and forget) the held tail; call when the request ends without a stop string."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    def _partial_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best


class TokenText(Protocol):
    """The token → text stage of a pipeline; ``text``: all its text so far, before the stop strings' cut."""

    text: str


class TextPipeline(ABC):
    """One choice's text pipeline: a token → text stage (``detok``, set by the subclass), then the stop strings.

    :meth:`add` and :meth:`finish` are the same for every pipeline; a subclass says what a token releases through
    the stop strings (:meth:`_step`) and what its stage holds at the end (:meth:`_drain`): :class:`TextStream`
    detokenizes incrementally, ``harmony_reader.HarmonyTextStream`` reads harmony messages.

    Attributes:
        text: all text released so far (what the client has been, or will be, sent).
        stopped: a stop string ended the output; the caller must abort the engine request.
    """

    detok: TokenText

    def __init__(self, stop: Sequence[str] = (), include_stop_str_in_output: bool = False):
        self.stops = StopChecker(stop, include_stop_str_in_output)
        self.text = ""

    @property
    def stopped(self) -> bool:
        return self.stops.stopped

    @abstractmethod
    def _step(self, token_id: int) -> str:
        """Feed one generated token to the stage; return the text it releases through the stop strings."""

    @abstractmethod
    def _drain(self) -> str:
        """At the end: the text the stage still holds, through the stop strings (the held tail of the stop
        strings is released after it)."""

    def add(self, token_ids: Sequence[int]) -> tuple[str, list[int]]:
        """Feed generated tokens one by one; return ``(released text, text offsets)``.

        ``offsets[i]`` is the character offset, in the stage's text (``detok.text``), at which token ``i``'s text
        starts (the legacy completions ``text_offset``).
        """
        out: list[str] = []
        offsets: list[int] = []
        for t in token_ids:
            offsets.append(len(self.detok.text))
            if not self.stops.stopped:
                out.append(self._step(t))
        delta = "".join(out)
        self.text += delta
        return delta, offsets

    def finish(self) -> str:
        """Release everything held (incomplete bytes, a possible stop prefix) at the end of the request."""
        if self.stops.stopped:
            return ""
        delta = self._drain()
        delta += self.stops.flush()   # "" once a stop string was found
        self.text += delta
        return delta


class Detokenizes(Protocol):
    """What :class:`TextStream` needs of a codec (``tokenizer.TextCodec``): a fresh incremental detokenizer."""

    def detokenizer(self, prompt_ids: Sequence[int] = (),
                    skip_special_tokens: bool = True) -> IncrementalDetokenizer: ...


class TextStream(TextPipeline):
    """The text pipeline of a plain choice: incremental detokenization (:class:`IncrementalDetokenizer`, made by
    ``codec``), then the stop strings."""

    def __init__(self, codec: Detokenizes, prompt_ids: Sequence[int], *, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True):
        super().__init__(stop, include_stop_str_in_output)
        self.detok = codec.detokenizer(prompt_ids, skip_special_tokens=skip_special_tokens)

    def _step(self, token_id: int) -> str:
        return self.stops.feed(self.detok.step((token_id,)))

    def _drain(self) -> str:
        return self.stops.feed(self.detok.flush())
