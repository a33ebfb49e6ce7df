"""The request and response types every API surface shares (pydantic v2): the request base, the one entry every
route parses its body through, usage, model cards, errors. The chat completions and completions schemas are
``chat_protocol.py``; the Responses and Anthropic surfaces keep theirs in their own modules.

Requests accept unknown fields (``extra="allow"``) and ignore them: rejecting them broke real clients
(API-COMPAT.md). The exception: fields that name the server's own request state or scheduling
(:data:`INTERNAL_FIELDS`, and any name starting with ``_``) are refused with 400 by :func:`parse_request`, so a
client can never believe it set them (or, should one ever be read, set them). NaN/Infinity are rejected for every
float field. Response models serialize to exactly the shapes in API-COMPAT.md.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, ValidationError, model_serializer

from ferrylm.engine.outputs import LOGPROB_FLOOR
from ferrylm.errors import InvalidRequest

# ---------------------------------------------------------------------------------------------------------
# requests
# ---------------------------------------------------------------------------------------------------------


class _Request(BaseModel):
    # strict: a field's JSON type is the one the schema states, as with OpenAI's API (no "3" or 3.0 for an int,
    # no 0 / "true" for a bool, no false as a token id); an int is still a valid float.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    def unknown_fields(self) -> list[str]:
        """Names of fields this server does not know (accepted and ignored)."""
        return sorted((self.model_extra or {}).keys())


# Names of the engine's and the supervisor's own request state: the engine request id (the server makes it;
# clients name a request with the x-request-id header), the isolation flag of a suspect request, scheduling
# priority and timing (the deadline comes from --request-timeout or the x-request-timeout header), the token
# bookkeeping, fault injection.
INTERNAL_FIELDS = frozenset({
    "request_id", "engine_id", "isolate", "priority", "arrival_time", "queue_time", "status", "prompt_token_ids",
    "output_token_ids", "num_computed_tokens", "page_table", "faults", "deadline",
})


def check_client_fields(body: dict) -> None:
    """Raise InvalidRequest (400, ``param`` the field) for a top-level field a client must not set."""
    for k in body:
        if k in INTERNAL_FIELDS or (isinstance(k, str) and k.startswith("_")):
            hint = " (name a request in the logs with the x-request-id header)" if k == "request_id" else ""
            raise InvalidRequest(f"'{k}' cannot be set by a client: it is the server's own request state{hint}",
                                 param=k)


def parse_request(model: type[_Request], body: Any) -> Any:
    """Validate a decoded JSON body into ``model``.

    Raises:
        InvalidRequest: with the first problem's location in ``param`` (e.g. ``messages.0.role``); a field of
            :data:`INTERNAL_FIELDS` (:func:`check_client_fields`).
    """
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    check_client_fields(body)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise invalid_from_errors(e.errors()) from None


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict", "any", "set", "tuple", "bytes"})


def _is_union_tag(x: Any) -> bool:
    """True for the parts of a pydantic error location that name a union member (``str``, ``list[str]``,
    ``dict[str,any]``, ``TextPart``, ``function-after[...]``, ``constrained-str``), not a request field (fields
    are snake_case: never a hyphen)."""
    return isinstance(x, str) and (x in _TYPE_TAGS or "[" in x or "-" in x or x[:1].isupper())


def invalid_from_errors(errors: list[dict]) -> InvalidRequest:
    """One InvalidRequest summarising pydantic/FastAPI validation errors. ``param`` names the field of the first
    error, without the union members pydantic puts in locations (``stop``, not ``stop.str``); of the errors one
    union gave, the deepest names it (``messages.0.content.0.text``: the member the value got furthest in)."""
    def loc_of(err: dict) -> list:
        return [x for x in err.get("loc", ()) if x != "body"]

    def clean(loc: list) -> str:
        return ".".join(str(x) for x in loc if not _is_union_tag(x)) or "body"

    param = None
    if errors:
        first = loc_of(errors[0])
        t = next((i for i, x in enumerate(first) if _is_union_tag(x)), None)
        group = [errors[0]]
        if t is not None:
            group = [e for e in errors if loc_of(e)[:t] == first[:t] and len(loc_of(e)) > t
                     and _is_union_tag(loc_of(e)[t])]
        best = max(group, key=lambda e: len([x for x in loc_of(e) if not _is_union_tag(x)]))
        param = clean(loc_of(best)) if loc_of(best) else None
    parts: list[str] = []
    for err in errors[:5]:
        part = f"{clean(loc_of(err))}: {err.get('msg', 'invalid value')}"
        if part not in parts:
            parts.append(part)
    more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
    return InvalidRequest("invalid request: " + "; ".join(parts) + more, param=param)


# ---------------------------------------------------------------------------------------------------------
# responses
# ---------------------------------------------------------------------------------------------------------


def _drop(keys: tuple[str, ...]) -> Any:
    """A wrap serializer that leaves out ``keys`` when they are None (fields most replies do not carry)."""
    def ser(self: Any, handler: Any) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None or k not in keys}
    return model_serializer(mode="wrap")(ser)


class PromptTokensDetails(BaseModel):
    """``cached_tokens``: prompt tokens whose K/V came from the prefix cache (OpenAI's field)."""

    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    """``reasoning_tokens``: generated tokens that were reasoning (a ``<think>`` block, harmony's analysis channel;
    OpenAI's field, chat only)."""

    reasoning_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None
    completion_tokens_details: Optional[CompletionTokensDetails] = None

    _ser = _drop(("completion_tokens_details",))

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
           reasoning_tokens: int | None = None) -> "UsageInfo":
        """Usage in tokens; ``reasoning_tokens`` None: no ``completion_tokens_details`` (the completions API)."""
        details = None if reasoning_tokens is None else CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
                   completion_tokens_details=details)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ferrylm"
    root: Optional[str] = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def chunk_json(model: BaseModel, *, include_usage: bool) -> str:
    """JSON of a stream chunk; the ``usage`` key appears only when the client asked for usage."""
    return model.model_dump_json(exclude=None if include_usage else {"usage"})


# ---------------------------------------------------------------------------------------------------------
# logprobs formatting
# ---------------------------------------------------------------------------------------------------------

def _finite(lp: float) -> float:
    """``lp`` as a JSON number: the sampler already floors logprobs; a non-finite value (a test double's, an older
    engine's) becomes ``LOGPROB_FLOOR``."""
    return float(lp) if math.isfinite(lp) else LOGPROB_FLOOR
