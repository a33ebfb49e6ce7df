"""Reasoning split: ``<think>…</think>`` at the start of an assistant turn becomes ``reasoning_content``.

On for chat templates that write ``</think>`` (Qwen3, QwQ, DeepSeek-R1 style); off otherwise (their output is
content only). Rules, decided on the text alone so that any chunking gives the same split:

- The output starts in reasoning when the prompt ends inside an open ``<think>`` (templates that open the block
  themselves, or a client prefill — a continued assistant message — that opened it, text after the tag or not), or when its first non-blank text is ``<think>``. Otherwise everything is content (a later
  ``<think>`` is content too).
- Reasoning ends at ``</think>``; blank lines right after ``<think>``, right before ``</think>`` and right after
  it are dropped. An output that ends while thinking is all reasoning.
- ``chat_template_kwargs.enable_thinking: false`` makes Qwen3's template close an empty block in the prompt, so
  the output is content from the first token.
- The families, by what their templates render (the split follows the prompt, never the model's name): DeepSeek-R1
  always ends the prompt with ``<think>\n`` (the output starts in reasoning); DeepSeek-V3.1 ends it with
  ``<think>`` when ``thinking`` is true and ``</think>`` (content) otherwise; Qwen3 / Qwen3.5 / Qwen3-Next thinking
  with ``<think>\n`` unless ``enable_thinking`` is false; Kimi-K2's (non-thinking) template writes no
  ``</think>``, so its output is content; DeepSeek-V3's prompt never opens a block, and the model does not
  write one, so its output is content too.
- A grammar-constrained output (a forced tool call, a JSON schema) is never reasoning: the server turns the
  template's :data:`THINKING_SWITCHES` off for it, and a prompt that still opened ``<think>`` (R1's) does not put
  the constrained output in reasoning (``server/api/app.py``).

This module must not import torch.
"""

from __future__ import annotations

from ferrylm.errors import InvalidRequest

OPEN = "<think>"
CLOSE = "</think>"
#: ``chat_template_kwargs`` that turn a template's thinking off when False (Qwen3 / Qwen3.5: ``enable_thinking``;
#: DeepSeek-V3.1: ``thinking``); the server sets them for a constrained output (a forced tool call, a JSON schema)
THINKING_SWITCHES = ("enable_thinking", "thinking")
#: the reasoning efforts a request may ask for (chat ``reasoning_effort``, Responses ``reasoning.effort``, Anthropic
#: ``thinking``): the template argument ``reasoning_effort`` (harmony's system message reads it)
REASONING_EFFORTS = ("low", "medium", "high")


def check_reasoning_effort(value: object, param: str) -> str | None:
    """``value`` as one of :data:`REASONING_EFFORTS` (None stays None). Raises InvalidRequest naming ``param``."""
    if value is None:
        return None
    if not isinstance(value, str) or value not in REASONING_EFFORTS:
        raise InvalidRequest(f"'{param}' must be one of {', '.join(REASONING_EFFORTS)}; got {value!r}", param=param)
    return value


def template_has_reasoning(chat_template: object) -> bool:
    """True when the template writes ``</think>`` blocks (then the reasoning split is on)."""
    if isinstance(chat_template, dict):
        return any(template_has_reasoning(v) for v in chat_template.values())
    return isinstance(chat_template, str) and CLOSE in chat_template


def prompt_opens_thinking(prompt_text: str, prefill: str | None = None) -> bool:
    """True when the rendered prompt ends inside a ``<think>`` block it opened (the output starts reasoning).

    ``prefill``: the text of the assistant message the output continues (``continue_final_message``, Anthropic's
    trailing assistant turn), None otherwise. A prefill that opens ``<think>`` and does not close it is inside the
    block whatever text follows the tag (``"<think>Let me see"``): the output goes on reasoning. Without a
    prefill only a prompt that ends right after ``<think>`` counts (a ``<think>`` in earlier text followed by
    more prompt is not the output's)."""
    if prefill is not None:
        j = prefill.rfind(OPEN)
        if j >= 0 and prefill.find(CLOSE, j) < 0:
            return True
    i = prompt_text.rfind(OPEN)
    return i >= 0 and prompt_text.find(CLOSE, i) < 0 and not prompt_text[i + len(OPEN):].strip()


def _partial(buf: str, tag: str) -> int:
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    """Feed text; get ``(reasoning, content)`` deltas. ``finish()`` releases what is held at the end."""

    def __init__(self, start_in_reasoning: bool = False):
        self._mode = "reasoning" if start_in_reasoning else "start"
        self._buf = ""
        self._ws = ""            # trailing blank of released reasoning, held until more reasoning follows
        self._lead = start_in_reasoning  # drop blank text at the start of the reasoning

    @property
    def in_reasoning(self) -> bool:
        """The text fed so far ends inside the reasoning block."""
        return self._mode == "reasoning"

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, content = [], []
        while self._buf:
            if self._mode == "start":
                s = self._buf.lstrip()
                if not s:
                    return "", ""
                if s.startswith(OPEN):
                    self._buf = s[len(OPEN):]
                    self._mode, self._lead = "reasoning", True
                    continue
                if OPEN.startswith(s):   # could still be the opening tag
                    return "", ""
                self._mode = "content"
                continue
            if self._mode == "content":
                content.append(self._buf)
                self._buf = ""
                break
            if self._mode == "after":    # blank run after </think>
                s = self._buf.lstrip()
                if not s:
                    self._buf = ""
                    break
                self._buf, self._mode = s, "content"
                continue
            j = self._buf.find(CLOSE)
            if j >= 0:
                reasoning.append(self._reason(self._buf[:j], final=True))
                self._buf = self._buf[j + len(CLOSE):]
                self._mode = "after"
                continue
            keep = _partial(self._buf, CLOSE)
            reasoning.append(self._reason(self._buf[:len(self._buf) - keep]))
            self._buf = self._buf[len(self._buf) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def _reason(self, text: str, final: bool = False) -> str:
        if self._lead:
            text = text.lstrip()
            if not text:
                return ""
            self._lead = False
        body = text.rstrip()
        out = ""
        if body:
            out, self._ws = self._ws + body, ""
        if not final:
            self._ws += text[len(body):]
        else:
            self._ws = ""
        return out

    def finish(self) -> tuple[str, str]:
        """Release the held text: an unfinished opening tag or blank start is content; an open block's rest is
        reasoning."""
        if self._mode == "start":
            rest, self._buf, self._mode = self._buf, "", "content"
            return "", rest
        if self._mode == "reasoning":
            text = self._reason(self._buf, final=True)
            self._buf = ""
            return text, ""
        rest, self._buf = self._buf, ""
        return ("", rest) if self._mode == "content" else ("", "")
