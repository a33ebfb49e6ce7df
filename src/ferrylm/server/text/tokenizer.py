"""Text in and out of token ids for the HTTP frontend: chat templates, encoding, and the codec's detokenizer (the
text-out pipeline, incremental detokenization and stop strings, is ``text_stream.py``).

The engine sees token ids only; everything textual happens here (DESIGN.md, "Processes"). This module must not
import torch: it loads the tokenizer through ``PreTrainedTokenizerFast`` when the folder has a ``tokenizer.json``
(that path of transformers does not import torch) and falls back to ``AutoTokenizer`` otherwise.

Text in: client text is never parsed as control tokens. :meth:`TextCodec.encode` tokenizes its text with the
special tokens (``<|im_end|>``, ``<|endoftext|>``, ... : the added tokens flagged special) spelled as text, so a
prompt cannot end a turn or forge a role; :meth:`TextCodec.apply_chat_template` renders the template with every
special-token string inside the client's messages (and tools, and string template arguments) replaced by a
placeholder, tokenizes the template's own markup with the special tokens parsed, and the placeholders as text.
Any route that tokenizes through TextCodec gets this. Added tokens that are not flagged special (Qwen3's
``<think>``, ``<tool_call>``) are still parsed: chat templates look for them in message content, and the model
writes them itself. Token-id prompts are the way to send control tokens on purpose.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
from functools import cached_property, lru_cache
from typing import Any, Sequence

from ferrylm.errors import InvalidRequest, ModelLoadError
from ferrylm.faults import NO_FAULTS
from ferrylm.server.text.text_stream import IncrementalDetokenizer

logger = logging.getLogger(__name__)

# chat_template_kwargs a client may not override: they change what apply_chat_template returns, replace the
# conversation, or inject a template of the client's choosing.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def client_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """A request's ``chat_template_kwargs`` without the reserved names (ignored, logged at debug), safe to pass
    as ``**kwargs`` next to :meth:`TextCodec.apply_chat_template`'s own arguments."""
    if not kwargs:
        return {}
    out = {k: v for k, v in kwargs.items() if k not in _RESERVED_TEMPLATE_KWARGS}
    if len(out) < len(kwargs):
        logger.debug("ignoring reserved chat_template_kwargs: %s", sorted(set(kwargs) - set(out)))
    return out


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-level alphabet: each byte 0..255 as a printable character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_FALLBACK_RE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _load_fast_tokenizer(path: str) -> Any:
    """Load a folder with a ``tokenizer.json`` without importing torch.

    ``AutoTokenizer`` imports the model-config machinery (and with it torch), so the class named by
    ``tokenizer_config.json`` (``tokenizer_class``) is looked up on the ``transformers`` package directly, which
    imports only that tokenizer's module; ``PreTrainedTokenizerFast`` is the fallback.
    """
    import transformers

    name = ""
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            name = str(json.load(f).get("tokenizer_class") or "")
    except (OSError, ValueError):
        pass
    if name.endswith(("Tokenizer", "TokenizerFast")):
        klass = getattr(transformers, name, None)
        if isinstance(klass, type) and issubclass(klass, transformers.PreTrainedTokenizerBase):
            try:
                return klass.from_pretrained(path)
            except Exception as e:  # noqa: BLE001 - fall back to the generic fast tokenizer
                logger.warning("loading %s with %s failed (%s); using PreTrainedTokenizerFast", path, name, e)
    return transformers.PreTrainedTokenizerFast.from_pretrained(path)


_NO_LIMIT = int(1e30)  # transformers' own value for a tokenizer without a length limit


class TextCodec:
    """A Hugging Face tokenizer plus the operations the server needs.

    Args:
        tokenizer: a transformers tokenizer (fast tokenizers are decoded through their ``tokenizers`` backend).
        name_or_path: for logs.

    All methods are synchronous and cheap enough for the event loop for ordinary prompt sizes.

    Attributes:
        faults: the frontend's fault injector (point ``detokenize``), handed to every detokenizer; off unless
            the server sets it (``server/process/launch.py``).
    """

    def __init__(self, tokenizer: Any, name_or_path: str = ""):
        self.tokenizer = tokenizer
        # the engine enforces the context limit (``max_model_len``) and answers an over-long prompt with a 400; the
        # tokenizer's own limit would only log transformers' "sequence length is longer" warning on such a prompt
        tokenizer.model_max_length = _NO_LIMIT
        self.name_or_path = name_or_path
        self.faults = NO_FAULTS
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(self._backend, "decoder", None) if self._backend is not None else None
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self.token_text = lru_cache(maxsize=65536)(self._token_text)  # type: ignore[method-assign]
        self.token_bytes = lru_cache(maxsize=65536)(self._token_bytes)  # type: ignore[method-assign]
        self.special_strings = _special_strings(tokenizer)
        self._special_re = re.compile("|".join(re.escape(t) for t in sorted(self.special_strings, key=len,
                                                                            reverse=True))) \
            if self.special_strings else None
        self._text_backend = None
        if self._backend is not None and self.special_strings:
            # NOTE: a copy of its own: ``encode_special_tokens`` is a setting of the whole Tokenizer object, and
            # tokenization runs in worker threads (never toggle a shared one)
            from tokenizers import Tokenizer

            self._text_backend = Tokenizer.from_str(self._backend.to_str())
            self._text_backend.encode_special_tokens = True

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "TextCodec":
        """A TextCodec over the tokenizer in ``path`` (:func:`load_tokenizer`; :meth:`from_tokenizer`). The served
        model's codec, harmony's for gpt-oss, is :func:`ferrylm.server.text.harmony.load_codec`'s choice.

        Raises:
            ModelLoadError: ``path`` has no loadable tokenizer.
        """
        return cls.from_tokenizer(load_tokenizer(path), path)

    @classmethod
    def from_tokenizer(cls, tok: Any, path: str | os.PathLike) -> "TextCodec":
        """A TextCodec over ``tok``, loaded from ``path``; a tokenizer without a chat template gets its model type's
        built-in one, if any (:mod:`ferrylm.server.text.builtin_templates`)."""
        path = os.fspath(path)
        if not getattr(tok, "chat_template", None) and os.path.isdir(path):
            from ferrylm.server.text.builtin_templates import folder_template

            tok.chat_template = folder_template(path)   # DeepSeek-V4 ships none (server/text/builtin_templates.py)
        return cls(tok, name_or_path=path)

    # ---- facts -------------------------------------------------------------------------------------------
    @cached_property
    def longest_token(self) -> int:
        """Characters of the longest vocabulary entry (special and added tokens included). No token covers more
        characters of a text, so ``n`` characters encode to at least about ``n / longest_token`` tokens (a
        normalizer composing characters, NFC, can at most halve them first)."""
        return max((len(t) for t in self.tokenizer.get_vocab()), default=1) or 1

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (base vocabulary + added tokens)."""
        return len(self.tokenizer)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The tokenizer's EOS id (empty when it has none)."""
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return () if eos is None else (int(eos),)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def renders_tools(self) -> bool:
        """The chat rendering writes ``tools`` itself (else they go in the system turn: ``tools.fallback_messages``)."""
        from ferrylm.server.text.tools import template_supports_tools

        return template_supports_tools(self.chat_template)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Token ids that end an assistant turn in the chat format, besides the model's EOS (none for templates)."""
        return ()

    # ---- text in -----------------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict], /, add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, *, continue_final_message: bool = False,
                    **chat_template_kwargs: Any) -> str:
        """Render ``messages`` with the tokenizer's chat template and return the prompt text.

        ``tools``: OpenAI-shape tool definitions for templates that render them. ``continue_final_message``: the
        last (assistant) message is left open so the model continues it (vLLM's field; no generation prompt).

        Raises:
            InvalidRequest: no chat template, or the template failed on these messages (param ``messages``).
        """
        if not self.has_chat_template:
            raise InvalidRequest("this model has no chat template; use /v1/completions with a raw prompt",
                                 param="messages")
        kwargs = {k: v for k, v in chat_template_kwargs.items() if k not in _RESERVED_TEMPLATE_KWARGS}
        dropped = set(chat_template_kwargs) - set(kwargs)
        if dropped:
            logger.debug("ignoring reserved chat_template_kwargs: %s", sorted(dropped))
        try:
            if continue_final_message:
                kwargs["continue_final_message"] = True
            text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:  # noqa: BLE001 - jinja2 TemplateError, TypeError, ... all come from the input
            logger.debug("chat template failed", exc_info=True)
            raise InvalidRequest(f"chat template error: {e}", param="messages") from e
        if not isinstance(text, str):
            raise InvalidRequest("chat template did not render to text", param="messages")
        return text

    def apply_chat_template(self, messages: list[dict], /, add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, *, continue_final_message: bool = False,
                            **chat_template_kwargs: Any) -> list[int]:
        """Render ``messages`` with the chat template and tokenize the result (no extra special tokens: the
        template writes its own BOS). Special-token strings inside the messages, tools and string arguments are
        tokenized as text; the template's own markup as the special tokens (module docstring). Raises
        InvalidRequest like :meth:`render_chat`."""
        if self._special_re is None:
            text = self.render_chat(messages, add_generation_prompt, tools,
                                    continue_final_message=continue_final_message, **chat_template_kwargs)
            return self._encode_markup(text)
        nonce = secrets.token_hex(8)
        found: list[str] = []

        def protect(value: Any) -> Any:
            if isinstance(value, str):
                def mark(m: re.Match) -> str:
                    found.append(m.group(0))
                    return f"\ufdd0{nonce}{len(found) - 1}\ufdd1"
                return self._special_re.sub(mark, value)
            if isinstance(value, dict):
                return {k: protect(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [protect(v) for v in value]
            return value

        text = self.render_chat(protect(messages), add_generation_prompt, protect(tools) if tools else tools,
                                continue_final_message=continue_final_message, **protect(chat_template_kwargs))
        if not found:
            return self._encode_markup(text)
        ids: list[int] = []
        pos = 0
        for m in re.finditer(f"\ufdd0{nonce}(\\d+)\ufdd1", text):
            ids += self._encode_markup(text[pos:m.start()])
            ids += self.encode(found[int(m.group(1))], add_special_tokens=False)
            pos = m.end()
        return ids + self._encode_markup(text[pos:])

    @property
    def chat_template(self) -> Any:
        """The template source (a string, or named templates), None without one."""
        return getattr(self.tokenizer, "chat_template", None)

    def set_chat_template(self, template: str) -> None:
        """Use ``template`` (Jinja text) instead of the tokenizer's own (``--chat-template``)."""
        self.tokenizer.chat_template = template

    def encode(self, prompt: str, add_special_tokens: bool = True, *, parse_special: bool = False) -> list[int]:
        """Token ids of client text ``prompt``: special-token strings in it are tokenized as text, never as the
        special tokens (``parse_special`` True parses them: text the server or the operator wrote, never a
        client's). ``add_special_tokens`` adds the tokenizer's BOS/EOS policy."""
        if parse_special or not self.special_strings:
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        if self._text_backend is not None:
            # NOTE: encode_batch, not encode: the tokenizers binding releases the GIL only in the batch call, and
            # prompts are tokenized in worker threads beside the event loop (a huge prompt must not stall /health)
            return list(self._text_backend.encode_batch([prompt], add_special_tokens=add_special_tokens)[0].ids)
        # a tokenizer without a fast backend (sentencepiece-only folders)
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens, split_special_tokens=True))

    def _encode_markup(self, text: str) -> list[int]:
        """Token ids of text the chat template wrote (its special-token strings are the special tokens)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    # ---- text out ----------------------------------------------------------------------------------------
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (no clean-up of tokenization spaces, so incremental and whole decodes agree)."""
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _token_text(self, token_id: int) -> str:
        """Text of one token as the logprobs ``token`` field (special tokens spelled out; may contain U+FFFD
        when the token is part of a multi-byte character)."""
        return self.decode([token_id], skip_special_tokens=False)

    def _token_bytes(self, token_id: int) -> bytes:
        """Raw UTF-8 bytes of one token (exact for byte-level BPE and ``<0xNN>`` byte-fallback tokens)."""
        piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
        if isinstance(piece, str):
            if self._byte_level and all(c in _BYTE_DECODER for c in piece):
                return bytes(_BYTE_DECODER[c] for c in piece)
            m = _BYTE_FALLBACK_RE.match(piece)
            if m:
                return bytes([int(m.group(1), 16)])
        return self.token_text(token_id).encode("utf-8")

    def detokenizer(self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        """A fresh :class:`IncrementalDetokenizer` whose context is the tail of ``prompt_ids``."""
        return IncrementalDetokenizer(self.decode, prompt_ids, skip_special_tokens=skip_special_tokens,
                                      faults=self.faults)


def load_tokenizer(path: str | os.PathLike) -> Any:
    """The transformers tokenizer in a Hugging Face folder (``trust_remote_code=False``) or built from a GGUF file's
    metadata. Raises ModelLoadError when there is none that loads."""
    path = os.fspath(path)
    try:
        if path.lower().endswith(".gguf") and os.path.isfile(path):  # built from the file's metadata
            from ferrylm.checkpoints.gguf_tokenizer import gguf_tokenizer

            return gguf_tokenizer(path)
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            return _load_fast_tokenizer(path)
        # slow / sentencepiece-only folders; this path may import torch inside transformers
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - any loader failure is a model-load problem
        raise ModelLoadError(f"cannot load a tokenizer from {path!r}: {e}") from e


def _special_strings(tokenizer: Any) -> frozenset[str]:
    """The text of every added token flagged special (``added_tokens_decoder``; ``all_special_tokens`` as a
    fallback): the strings a client must not be able to turn into control tokens."""
    out: set[str] = set()
    try:
        for tok in getattr(tokenizer, "added_tokens_decoder", {}).values():
            if getattr(tok, "special", False) and getattr(tok, "content", ""):
                out.add(str(tok.content))
    except Exception:  # noqa: BLE001 - an exotic tokenizer: fall back below
        pass
    if not out:
        out.update(str(t) for t in (getattr(tokenizer, "all_special_tokens", None) or []) if t)
    return frozenset(out)



def load_chat_template(value: str) -> str:
    """``--chat-template``: a file path (read), or the Jinja text itself (vLLM takes both). Raises ModelLoadError
    for a path that names no readable file and is no template either, and for a template Jinja cannot parse."""
    text = value
    looks_inline = "{{" in value or "{%" in value
    if not looks_inline:
        if not os.path.isfile(value):
            raise ModelLoadError(f"--chat-template {value!r}: no such file (give a template file or the Jinja text "
                                 f"itself)")
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"--chat-template {value!r}: cannot read it: {e}") from None
    try:
        import jinja2.sandbox

        jinja2.sandbox.ImmutableSandboxedEnvironment().parse(text)
    except Exception as e:  # noqa: BLE001 - jinja2.TemplateSyntaxError and friends
        raise ModelLoadError(f"--chat-template: not a valid Jinja template: {e}") from None
    return text
