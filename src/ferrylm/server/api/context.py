"""A chat-like request in the server's terms (:class:`ChatJob`, built by every chat-like surface) and what a route
module gets from the app: :class:`RouteContext`, the narrow interface the API surfaces (chat completions, Anthropic
Messages, the Responses API, the render routes) use, and the values it hands them.

``app.py``'s server implements it; a route never reaches into the app object. A surface that needs more declares
it as a Protocol of its own (``responses.ResponsesContext``, ``render.RenderContext``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.errors import InvalidRequest
from ferrylm.server.text.tools import ToolChoice, ToolSpec, tool_call_grammar

if TYPE_CHECKING:
    from fastapi import Request

    from ferrylm.server.api.assistant import TurnConfig
    from ferrylm.server.api.generation import Generation
    from ferrylm.server.api.chat_format import ChatFormat
    from ferrylm.server.api.protocol import UsageInfo
    from ferrylm.server.text.tokenizer import TextCodec

DEFAULT_SSE_PING_INTERVAL = 15.0   # --sse-ping-interval: seconds of silence before a stream's keep-alive


@dataclass
class ChatJob:
    """A chat-like request ready to render and run.

    Attributes:
        messages: template messages (OpenAI chat shape: ``role``, ``content`` text, ``tool_calls``,
            ``tool_call_id``, ``reasoning_content``).
        params: sampling parameters; ``params.grammar`` is the output constraint (``grammar_param`` names the
            request field it came from, for errors).
        tools / tool_choice: the function tools and how they may be used.
        template_kwargs: ``chat_template_kwargs`` the client may set (``enable_thinking`` ...).
        continue_final_message: the last (assistant) message is continued instead of starting a new one.
        max_param / prompt_param: request field names for context-length errors.
    """

    messages: list[dict]
    params: SamplingParams
    tools: list[ToolSpec] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    template_kwargs: dict = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    grammar_param: str | None = None
    max_param: str = "max_tokens"
    prompt_param: str = "messages"
    tool_choice_param: str = "tool_choice"
    stream: bool = False
    unknown_fields: list[str] = field(default_factory=list)   # request fields this server ignores (logged)

    def apply_tool_choice(self, tags: tuple[str, str] | None = None, fmt: str = "hermes", term=None) -> None:
        """Set ``params.grammar`` for a forced tool call in the served model's call format ``fmt`` (``tags``: the
        Hermes tags' Lark terms for the served vocabulary, :func:`ferrylm.server.text.tools.tag_terms`; ``term``: the
        text -> Lark term function the other formats use, :func:`ferrylm.server.text.tools.lark_term`). Raises
        InvalidRequest when the request also asks for another output constraint (the tool call and, say, a JSON
        schema cannot both hold)."""
        if fmt == "hermes":
            grammar = tool_call_grammar(self.tools, self.tool_choice, tags=tags)
        else:
            from ferrylm.server.text.tool_parsers.grammars import forced_call_grammar

            grammar = forced_call_grammar(fmt, self.tools, self.tool_choice, *([term] if term else []))
        if grammar is None:
            return
        if self.params.grammar is not None:
            raise InvalidRequest(f"'{self.tool_choice_param}' {self.tool_choice.mode!r} forces a tool call; it "
                                 f"cannot be combined with '{self.grammar_param}'", param=self.tool_choice_param)
        self.params.grammar = grammar
        self.grammar_param = self.tool_choice_param


@dataclasses.dataclass
class PreparedChat:
    """A chat-like request rendered and checked, not started: the prompt text and ids, and the ``max_tokens`` the
    context leaves it (its own, or the rest of the context)."""

    text: str
    prompt_ids: list[int]
    max_tokens: int


@dataclasses.dataclass
class ChatRun:
    """A started chat-like request: its generation, the prompt ids and how its output is read."""

    gen: Generation
    prompt_ids: list[int]
    turn: TurnConfig


class RouteContext(Protocol):
    """What the route modules use of the served model and the request lifecycle.

    Attributes:
        codec: the served tokenizer and chat template.
        ping_interval: seconds of silence after which a stream gets a keep-alive; None: never, not even the
            opening one a route without an opening event of its own sends with its headers.
        chat_format: how the served model speaks a chat turn (the template's tools, the call format, ...).
    """

    codec: TextCodec
    ping_interval: float | None
    chat_format: ChatFormat

    def check_model(self, name: str | None) -> str:
        """The served model's name for a request's ``model`` field (None: absent). Raises ModelNotFound for a name
        not served, ``""`` included."""

    async def prepare_chat(self, job: ChatJob) -> PreparedChat:
        """Render and check a chat-like request without starting it. Raises InvalidRequest /
        ContextLengthExceeded."""

    async def run_chat(self, request: Request, rid: str, job: ChatJob, kind: str, base_id: str) -> ChatRun:
        """Prepare, admit and start a chat-like request (``kind``: the metrics label)."""

    def log_done(self, rid: str, gen: Generation, usage: UsageInfo) -> None:
        """Log and count a finished request."""

    def stream_error(self, rid: str, e: Exception) -> str:
        """Log and count an error inside a stream; the SSE error event to send."""
