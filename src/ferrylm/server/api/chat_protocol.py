"""The chat completions and (legacy) completions schemas (pydantic v2), the request → SamplingParams mapping, and
the chat and legacy logprobs shapes. What every surface shares (the request base, ``parse_request``, usage) is
``protocol.py``.

Response models serialize to exactly the shapes in API-COMPAT.md: ``finish_reason`` is always present (``null``
while running), stream deltas omit the fields they do not carry.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field, field_validator, model_serializer

from ferrylm.engine.outputs import TokenLogprob
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.errors import InvalidRequest
from ferrylm.server.api.protocol import UsageInfo, _drop, _finite, _Request

# ---------------------------------------------------------------------------------------------------------
# requests
# ---------------------------------------------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False   # vLLM: usage on every chunk


class ContentPart(_Request):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is served."""

    type: str
    text: Optional[str] = None


class ChatMessage(_Request):
    """A chat message. ``developer`` is accepted as a synonym of ``system``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_call_id: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    reasoning_content: Optional[str] = None


class _SamplingRequest(_Request):
    """Fields shared by chat completions and completions (OpenAI + vLLM/SGLang extras)."""

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: Optional[int] = 1
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    # vLLM / SGLang extras (the SDK sends them through extra_body)
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    ignore_eos: Optional[bool] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    # structured output (server/text/structured.py) and vLLM's token-id echo
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    return_token_ids: Optional[bool] = None

    @property
    def include_usage(self) -> bool:
        """``stream_options.include_usage`` (stream only; ``stream_options`` without ``stream`` is a 400)."""
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``stream_options.continuous_usage_stats``: usage on every chunk."""
        return bool(self.stream and self.stream_options is not None and self.stream_options.continuous_usage_stats)

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` wins over ``max_tokens``; None when neither is given."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    reasoning_effort: Any = None   # low | medium | high (checked by reasoning.check_reasoning_effort)
    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = None
    tools: Optional[list[Any]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    user: Optional[str] = None
    metadata: Optional[dict[str, str]] = None


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. ``prompt`` is a string, a list of strings, token ids, or a list of token-id lists."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None
    echo: Optional[bool] = False
    suffix: Optional[str] = None
    prompt_logprobs: Optional[int] = None

    @field_validator("logprobs", mode="before")
    @classmethod
    def _bool_logprobs(cls, v: Any) -> Any:
        """Lenient: ``false`` means off (not "0 alternatives"), ``true`` means 1."""
        if isinstance(v, bool):
            return 1 if v else None
        return v


class TokenizeRequest(_Request):
    """POST /tokenize: ``prompt`` or chat ``messages``."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = True
    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[Any]] = None


class DetokenizeRequest(_Request):
    """POST /detokenize."""

    model: Optional[str] = None
    tokens: list[int]


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _logit_bias(bias: dict[str, float] | None) -> list[list[float]]:
    """OpenAI ``logit_bias`` (token id as a string -> bias) as ``[[token id, bias], ...]`` sorted by id.

    Raises:
        InvalidRequest: a key that is not a token id, or two keys for one id (``"1"`` and ``"01"``)
            (``param: logit_bias``).
    """
    out: dict[int, float] = {}
    for k, v in (bias or {}).items():
        try:
            tok = int(k)
        except ValueError:
            raise InvalidRequest(f"'logit_bias' keys must be token ids, got {k!r}", param="logit_bias") from None
        if tok in out:
            raise InvalidRequest(f"'logit_bias' names token {tok} twice", param="logit_bias")
        out[tok] = float(v)
    return [[t, out[t]] for t in sorted(out)]


def to_sampling_params(req: _SamplingRequest) -> SamplingParams:
    """Map a chat or completions request onto :class:`SamplingParams` and validate it.

    - ``max_completion_tokens`` wins over ``max_tokens``; when both are absent ``max_tokens`` is None and the
      caller fills in the endpoint's default once the prompt length is known.
    - ``stop`` string → one-element list; OpenAI defaults (temperature 1, top_p 1, n 1) for absent fields.
    - chat ``logprobs: true`` → ``logprobs = top_logprobs or 0``; completions ``logprobs`` is the count itself.

    Raises:
        InvalidRequest: a value is out of range (``param`` names the request field).
    """
    def num(v: Any, default: Any) -> Any:
        return default if v is None else v

    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= SamplingParams.MAX_LOGPROBS:
            raise InvalidRequest(f"'top_logprobs' must be in [0, {SamplingParams.MAX_LOGPROBS}], got "
                                 f"{req.top_logprobs}", param="top_logprobs")
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs  # type: ignore[attr-defined]
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if req.stop_token_ids is not None and any(t < 0 for t in req.stop_token_ids):
        raise InvalidRequest("'stop_token_ids' must be non-negative token ids", param="stop_token_ids")
    params = SamplingParams(
        temperature=float(num(req.temperature, 1.0)),
        top_p=float(num(req.top_p, 1.0)),
        top_k=int(num(req.top_k, -1)),
        min_p=float(num(req.min_p, 0.0)),
        seed=req.seed,
        max_tokens=req.requested_max_tokens,
        min_tokens=int(num(req.min_tokens, 0)),
        n=int(num(req.n, 1)),
        stop=_stop_list(req.stop),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        skip_special_tokens=True if req.skip_special_tokens is None else bool(req.skip_special_tokens),
        presence_penalty=float(num(req.presence_penalty, 0.0)),
        frequency_penalty=float(num(req.frequency_penalty, 0.0)),
        repetition_penalty=float(num(req.repetition_penalty, 1.0)),
        logprobs=logprobs,
        logit_bias=_logit_bias(req.logit_bias),
        prompt_logprobs=getattr(req, "prompt_logprobs", None),
    )
    try:
        params.validate()
    except InvalidRequest as e:
        if e.param == "max_tokens" and req.max_completion_tokens is not None:
            e.rename_param("max_completion_tokens")
        raise
    return params


# ---------------------------------------------------------------------------------------------------------
# responses
# ---------------------------------------------------------------------------------------------------------


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    """``content`` is always present (null for a reply made only of tool calls); ``reasoning_content`` and
    ``tool_calls`` only when there are some."""

    role: str = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[ToolCallOut]] = None

    _ser = _drop(("reasoning_content", "tool_calls"))


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    token_ids: Optional[list[int]] = None   # vLLM return_token_ids

    _ser = _drop(("token_ids",))


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_token_ids: Optional[list[int]] = None   # vLLM return_token_ids

    _ser = _drop(("prompt_token_ids",))


class DeltaMessage(BaseModel):
    """A stream delta; fields that are None are left out (``{"content": "x"}``, ``{}`` at the end)."""

    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    token_ids: Optional[list[int]] = None

    _ser = _drop(("token_ids",))


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None


class CompletionLogprobs(BaseModel):
    """The legacy completions logprobs shape."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    token_ids: Optional[list[int]] = None          # vLLM return_token_ids
    prompt_token_ids: Optional[list[int]] = None   # vLLM return_token_ids (first chunk of a stream)
    prompt_logprobs: Optional[list[Optional[dict[str, Any]]]] = None   # vLLM prompt_logprobs

    _ser = _drop(("token_ids", "prompt_token_ids", "prompt_logprobs"))


class CompletionResponse(BaseModel):
    """Also the stream chunk shape (``object`` is "text_completion" for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


# ---------------------------------------------------------------------------------------------------------
# logprobs formatting
# ---------------------------------------------------------------------------------------------------------

def chat_logprobs(entries: list[TokenLogprob], codec: Any) -> list[ChatTokenLogprob]:
    """Chat-shape logprobs for ``entries`` (``codec`` gives ``token_text`` / ``token_bytes``)."""
    out = []
    for e in entries:
        top = [ChatTopLogprob(token=codec.token_text(t), logprob=_finite(lp), bytes=list(codec.token_bytes(t)))
               for t, lp in e.top]
        out.append(ChatTokenLogprob(token=codec.token_text(e.token_id), logprob=_finite(e.logprob),
                                    bytes=list(codec.token_bytes(e.token_id)), top_logprobs=top))
    return out


def completion_logprobs(entries: list[TokenLogprob], offsets: list[int], codec: Any,
                        num_top: int) -> CompletionLogprobs:
    """Legacy-shape logprobs; ``offsets`` are the character offsets of each token's text in the choice text."""
    lp = CompletionLogprobs()
    for e, off in zip(entries, offsets):
        tok = codec.token_text(e.token_id)
        lp.tokens.append(tok)
        lp.token_logprobs.append(_finite(e.logprob))
        top = {codec.token_text(t): _finite(v) for t, v in e.top}
        if tok not in top:   # the sampled token is always among them (logprobs 0: it alone), as OpenAI's
            top[tok] = _finite(e.logprob)
        lp.top_logprobs.append(top)
        lp.text_offset.append(off)
    return lp
