"""The harmony chat format of gpt-oss, rendered and read by the ``openai-harmony`` library.

A tokenizer whose vocabulary has harmony's control tokens at their ids (``<|start|>`` = 200006, ``<|channel|>`` =
200005, ...: :func:`is_harmony_vocab`) is served as a :class:`HarmonyCodec`: the same :class:`TextCodec`, whose chat
rendering is harmony's instead of a Jinja template. The output is read by channel (:class:`HarmonyReader`,
``server/text/harmony_reader.py``).

Rendering (:func:`harmony_messages`): a ``system`` message (harmony's own: model identity, knowledge cutoff, today's
date, ``Reasoning: low|medium|high`` from the ``reasoning_effort`` template argument, medium by default, the
channels); a ``developer`` message with the client's system / developer texts as its instructions, the reply's JSON
schema as a ``# Response Formats`` section after them (a ``json_schema`` ``response_format``), and the offered
function tools; then the conversation: user turns, assistant turns (``reasoning_content`` on the ``analysis``
channel, content on ``final`` — on ``commentary`` beside tool calls —, each call on ``commentary`` to
``functions.NAME`` as ``<|constrain|>json``), tool results from ``functions.NAME`` (the name found by the result's
``tool_call_id``). Analysis before a later final answer is dropped, as harmony does. Client text never becomes a
control token (harmony encodes message text as text).

The library's vocabulary (o200k_base, checked by its SHA-256) comes from the served tokenizer itself
(:func:`harmony_encoding`: its ids 0..199997 written as ``o200k_base.tiktoken`` under the cache dir, and
``TIKTOKEN_ENCODINGS_BASE`` pointed there), so nothing is downloaded.

This module must not import torch.
"""

from __future__ import annotations

import base64
import datetime
import functools
import json
import os
from pathlib import Path
from typing import Any, Sequence

import openai_harmony as oh

from ferrylm.errors import InvalidRequest, ModelLoadError
from ferrylm.server.text.reasoning import check_reasoning_effort
from ferrylm.server.text.tokenizer import _BYTE_DECODER, TextCodec, load_tokenizer

#: harmony's control tokens and their ids in the gpt-oss vocabulary (o200k_harmony)
CONTROL_TOKENS = {"<|return|>": 200002, "<|constrain|>": 200003, "<|channel|>": 200005, "<|start|>": 200006,
                  "<|end|>": 200007, "<|message|>": 200008, "<|call|>": 200012}
START, END, CHANNEL = CONTROL_TOKENS["<|start|>"], CONTROL_TOKENS["<|end|>"], CONTROL_TOKENS["<|channel|>"]
#: ids that close a message: ``<|end|>``, ``<|call|>`` (a tool call), ``<|return|>`` (the final answer)
MESSAGE_ENDS = frozenset({END, CONTROL_TOKENS["<|call|>"], CONTROL_TOKENS["<|return|>"]})
BASE_RANKS = 199998        # o200k_base's mergeable tokens: ids 0 .. 199997
VOCAB_FILE = "o200k_base.tiktoken"
TOOL_NAMESPACE = "functions"
JSON_CONTENT_TYPE = "<|constrain|>json"


def is_harmony_vocab(tokenizer: Any) -> bool:
    """True when ``tokenizer`` (a transformers tokenizer) has every harmony control token at its harmony id."""
    try:
        return all(tokenizer.convert_tokens_to_ids(t) == i for t, i in CONTROL_TOKENS.items())
    except Exception:  # noqa: BLE001 - a tokenizer that cannot answer is not harmony's
        return False


def load_codec(path: str | os.PathLike) -> TextCodec:
    """The codec serving the tokenizer in ``path`` (a folder or a GGUF file): a :class:`HarmonyCodec` for a harmony
    vocabulary (gpt-oss), else a :class:`TextCodec` (:meth:`TextCodec.from_tokenizer`). Raises ModelLoadError."""
    tok = load_tokenizer(path)
    if is_harmony_vocab(tok):   # gpt-oss: the chat format is harmony's
        return HarmonyCodec(tok, name_or_path=os.fspath(path))
    return TextCodec.from_tokenizer(tok, path)


def vocab_file_bytes(tokenizer: Any) -> bytes:
    """``o200k_base.tiktoken`` (a line ``base64(token bytes) rank`` per id 0..199997) from a byte-level BPE
    tokenizer's vocabulary. Raises ModelLoadError when those ids are not byte-level tokens."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(BASE_RANKS)))
    lines = []
    for rank, piece in enumerate(pieces):
        if not isinstance(piece, str) or not piece or any(c not in _BYTE_DECODER for c in piece):
            raise ModelLoadError(f"the tokenizer has harmony's control tokens but its id {rank} ({piece!r}) is "
                                 f"not a byte-level token of o200k_base")
        lines.append(base64.b64encode(bytes(_BYTE_DECODER[c] for c in piece)) + b" %d\n" % rank)
    return b"".join(lines)


@functools.lru_cache(maxsize=None)
def _load(folder: str) -> oh.HarmonyEncoding:
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = folder   # the library's only way to be given a local vocabulary
    return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)


def harmony_encoding(tokenizer: Any, cache_dir: Path | None = None) -> oh.HarmonyEncoding:
    """The gpt-oss harmony encoding, its vocabulary file written from ``tokenizer`` under ``cache_dir`` (default
    ``<cache root>/harmony``) when missing or different. Raises ModelLoadError when the library refuses it (the
    vocabulary is not o200k_base: its hash differs)."""
    from ferrylm.cachedir import cache_root

    folder = cache_dir or cache_root() / "harmony"
    data = vocab_file_bytes(tokenizer)
    path = folder / VOCAB_FILE
    if not path.is_file() or path.read_bytes() != data:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{VOCAB_FILE}.{os.getpid()}"
        tmp.write_bytes(data)
        os.replace(tmp, path)
    try:
        return _load(str(folder))
    except oh.HarmonyError as e:
        raise ModelLoadError(f"openai-harmony refused the vocabulary of this tokenizer (ids 0..{BASE_RANKS - 1} "
                             f"are not o200k_base): {e}") from None


def _text(m: dict) -> str:
    c = m.get("content")
    if isinstance(c, list):
        return "".join(p.get("text", "") for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
    return c if isinstance(c, str) else ""


def _assistant(text: str, channel: str) -> oh.Message:
    return oh.Message.from_role_and_content(oh.Role.ASSISTANT, text).with_channel(channel)


def _assistant_turn(m: dict, call_names: dict[str, str]) -> list[oh.Message]:
    """An assistant message as harmony messages: analysis, then the text (final; commentary beside calls), then
    one commentary message per call (``call_names``: call id -> function name, filled for the tool results)."""
    out = []
    if isinstance(m.get("reasoning_content"), str) and m["reasoning_content"]:
        out.append(_assistant(m["reasoning_content"], "analysis"))
    calls = m.get("tool_calls") or []
    if _text(m) or not calls:
        out.append(_assistant(_text(m), "commentary" if calls else "final"))
    for c in calls:
        fn = c.get("function", {})
        args = fn.get("arguments", {})
        if c.get("id") is not None:
            call_names[str(c["id"])] = fn["name"]
        out.append(_assistant(args if isinstance(args, str) else json.dumps(args, ensure_ascii=False), "commentary")
                   .with_recipient(f"{TOOL_NAMESPACE}.{fn['name']}").with_content_type(JSON_CONTENT_TYPE))
    return out


def response_formats_section(reply: dict) -> str:
    """Harmony's ``# Response Formats`` section for the reply's schema (``{"name", "description", "schema"}``:
    ``structured.response_format_prompt``)."""
    note = f"// {reply['description']}\n" if reply.get("description") else ""
    schema = json.dumps(reply["schema"], ensure_ascii=False, separators=(",", ":"))
    return f"# Response Formats\n\n## {reply['name']}\n\n{note}{schema}"


def _developer(instructions: str, tools: list[dict] | None, reply: dict | None) -> oh.Message | None:
    """The developer message: the client's instructions, the reply's schema after them (``# Response Formats``),
    the function tools; a plain text message when only the schema is there. None when there is nothing to say."""
    if reply is not None:
        section = response_formats_section(reply)
        if not instructions and not tools:
            return oh.Message.from_role_and_content(oh.Role.DEVELOPER, section)
        instructions = f"{instructions}\n\n{section}" if instructions else section
    if not instructions and not tools:
        return None
    dev = oh.DeveloperContent.new()
    if instructions:
        dev = dev.with_instructions(instructions)
    if tools:
        dev = dev.with_function_tools([oh.ToolDescription.new(
            t["function"]["name"], t["function"].get("description") or "", t["function"].get("parameters"))
            for t in tools])
    return oh.Message.from_role_and_content(oh.Role.DEVELOPER, dev)


def harmony_messages(messages: list[dict], tools: list[dict] | None, effort: str | None,
                     reply: dict | None = None) -> list[oh.Message]:
    """Template messages (OpenAI chat shape) → harmony messages (module docstring). ``tools``: OpenAI-shape function
    tools to offer; ``effort``: low | medium | high (None: medium); ``reply``: the reply's JSON schema
    (``structured.response_format_prompt``), shown in the developer message. Raises InvalidRequest for a tool
    result that answers no earlier call and for an unknown role (param ``messages``)."""
    system = oh.SystemContent.new().with_conversation_start_date(datetime.date.today().isoformat())
    system = system.with_reasoning_effort(oh.ReasoningEffort((effort or "medium").capitalize()))
    out = [oh.Message.from_role_and_content(oh.Role.SYSTEM, system)]
    instructions = "\n\n".join(t for m in messages if m.get("role") in ("system", "developer") and (t := _text(m)))
    dev = _developer(instructions, tools, reply)
    if dev is not None:
        out.append(dev)
    call_names: dict[str, str] = {}
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "user":
            out.append(oh.Message.from_role_and_content(oh.Role.USER, _text(m)))
        elif role == "assistant":
            out += _assistant_turn(m, call_names)
        elif role == "tool":
            name = call_names.get(str(m.get("tool_call_id"))) or m.get("name")
            if not isinstance(name, str) or not name:
                raise InvalidRequest(f"message {i}: a tool result must answer an earlier tool call (its "
                                     f"'tool_call_id' {m.get('tool_call_id')!r} names none)", param="messages")
            author = oh.Author.new(oh.Role.TOOL, f"{TOOL_NAMESPACE}.{name}")
            out.append(oh.Message.from_author_and_content(author, _text(m)).with_channel("commentary")
                       .with_recipient("assistant"))
        elif role not in ("system", "developer"):
            raise InvalidRequest(f"message {i}: role {role!r} is not supported", param="messages")
    return out


def open_message(prompt_ids: Sequence[int]) -> list[int]:
    """The prompt's last message when it is left open (from its ``<|start|>``: the generation prompt
    ``<|start|>assistant``, or a continued assistant message): what the output reader is primed with."""
    for i in range(len(prompt_ids) - 1, -1, -1):
        t = prompt_ids[i]
        if t in MESSAGE_ENDS:
            return []
        if t == START:
            return list(prompt_ids[i:])
    return []


class HarmonyCodec(TextCodec):
    """A :class:`TextCodec` whose chat rendering is harmony's (module docstring). ``encoding``: the library's
    encoding. Raises ModelLoadError (construction) when the library refuses the vocabulary."""

    def __init__(self, tokenizer: Any, name_or_path: str = ""):
        super().__init__(tokenizer, name_or_path)
        self.encoding = harmony_encoding(tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return True

    @property
    def renders_tools(self) -> bool:
        return True

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end an assistant turn: ``<|return|>`` and ``<|call|>``."""
        return tuple(sorted(self.encoding.stop_tokens_for_assistant_actions()))

    def set_chat_template(self, template: str) -> None:
        raise ModelLoadError("--chat-template: this tokenizer is harmony's (gpt-oss); its chat format is rendered "
                             "by openai-harmony, not by a template")

    def render_ids(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                   *, continue_final_message: bool = False, **kwargs: Any) -> list[int]:
        """The prompt ids of ``messages``: open for the assistant (``add_generation_prompt``), the last message
        left open (``continue_final_message``), or closed. ``kwargs``: template arguments; ``reasoning_effort`` and
        ``response_format`` (the reply's schema) are read. Raises InvalidRequest for bad messages, effort or
        schema."""
        effort = check_reasoning_effort(kwargs.get("reasoning_effort"), "chat_template_kwargs.reasoning_effort")
        reply = kwargs.get("response_format")
        if reply is not None and not (isinstance(reply, dict) and isinstance(reply.get("name"), str)
                                      and "schema" in reply):
            raise InvalidRequest("'chat_template_kwargs.response_format' must be an object with 'name' and 'schema'",
                                 param="chat_template_kwargs.response_format")
        conv = oh.Conversation.from_messages(harmony_messages(messages, tools, effort, reply))
        try:
            if add_generation_prompt and not continue_final_message:
                return list(self.encoding.render_conversation_for_completion(conv, oh.Role.ASSISTANT))
            ids = list(self.encoding.render_conversation(conv))
        except oh.HarmonyError as e:
            raise InvalidRequest(f"harmony could not render these messages: {e}", param="messages") from None
        return ids[:-1] if continue_final_message and ids and ids[-1] == END else ids

    def render_chat(self, messages: list[dict], /, add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, *, continue_final_message: bool = False,
                    **chat_template_kwargs: Any) -> str:
        return self.decode(self.render_ids(messages, add_generation_prompt, tools,
                                           continue_final_message=continue_final_message, **chat_template_kwargs),
                           skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], /, add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, *, continue_final_message: bool = False,
                            **chat_template_kwargs: Any) -> list[int]:
        return self.render_ids(messages, add_generation_prompt, tools, continue_final_message=continue_final_message,
                               **chat_template_kwargs)
