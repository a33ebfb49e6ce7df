"""Request models and the request → SamplingParams mapping."""

from __future__ import annotations

import pytest

from ferrylm.errors import InvalidRequest
from ferrylm.server.api.chat_protocol import (ChatCompletionChunk, ChatCompletionStreamChoice, ChatCompletionRequest,
                                              CompletionRequest, DeltaMessage, to_sampling_params)
from ferrylm.server.api.protocol import chunk_json, parse_request

MSGS = [{"role": "user", "content": "hi"}]


def chat(**kw) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {"model": "m", "messages": MSGS, **kw})


def test_defaults_follow_openai() -> None:
    p = to_sampling_params(chat())
    assert (p.temperature, p.top_p, p.n, p.max_tokens, p.stop, p.logprobs, p.top_k) == (1.0, 1.0, 1, None, [], None, -1)


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert to_sampling_params(chat(max_tokens=5, max_completion_tokens=7)).max_tokens == 7
    assert to_sampling_params(chat(max_tokens=5)).max_tokens == 5


def test_stop_string_becomes_a_list() -> None:
    assert to_sampling_params(chat(stop="END")).stop == ["END"]
    assert to_sampling_params(chat(stop=["a", "b"])).stop == ["a", "b"]


def test_chat_logprobs_map_to_top_logprobs_count() -> None:
    assert to_sampling_params(chat(logprobs=True, top_logprobs=3)).logprobs == 3
    assert to_sampling_params(chat(logprobs=True)).logprobs == 0
    assert to_sampling_params(chat(logprobs=False)).logprobs is None
    with pytest.raises(InvalidRequest, match="needs 'logprobs'"):  # vLLM's rule
        to_sampling_params(chat(logprobs=False, top_logprobs=3))
    with pytest.raises(InvalidRequest, match=r"must be in \[0, 20\], got -1"):  # the range first, whatever logprobs
        to_sampling_params(chat(top_logprobs=-1))


def test_logit_bias_maps_to_sorted_pairs() -> None:
    assert to_sampling_params(chat(logit_bias={"17": -100, "3": 2.5})).logit_bias == [[3, 2.5], [17, -100.0]]
    assert to_sampling_params(chat()).logit_bias == []


def test_completions_logprobs_is_the_count() -> None:
    req = parse_request(CompletionRequest, {"prompt": "x", "logprobs": 2})
    assert to_sampling_params(req).logprobs == 2


def test_vllm_extras_pass_through() -> None:
    p = to_sampling_params(chat(top_k=5, min_p=0.1, repetition_penalty=1.1, min_tokens=2, ignore_eos=True,
                                stop_token_ids=[7], include_stop_str_in_output=True, skip_special_tokens=False,
                                seed=3, presence_penalty=0.5, frequency_penalty=-0.5))
    assert (p.top_k, p.min_p, p.repetition_penalty, p.min_tokens, p.ignore_eos, p.stop_token_ids,
            p.include_stop_str_in_output, p.skip_special_tokens, p.seed, p.presence_penalty,
            p.frequency_penalty) == (5, 0.1, 1.1, 2, True, [7], True, False, 3, 0.5, -0.5)


def test_unknown_fields_are_accepted() -> None:
    req = chat(tools=[], response_format={"type": "text"}, user="u", some_future_field=1)
    assert req.unknown_fields() == ["some_future_field"]


@pytest.mark.parametrize("field,value", [("user", 5), ("metadata", "x"), ("metadata", {"k": 1})])
def test_user_and_metadata_have_openai_types(field, value) -> None:
    """``user`` a string, ``metadata`` string to string, as OpenAI's API checks them (new-user trial)."""
    with pytest.raises(InvalidRequest) as e:
        chat(**{field: value})
    assert e.value.param.startswith(field)


def test_stream_options_without_stream_is_a_400() -> None:
    """As OpenAI and vLLM answer it (``stream_options`` is only allowed with ``stream: true``)."""
    for extra in ({}, {"stream": False}):
        with pytest.raises(InvalidRequest) as e:
            to_sampling_params(chat(stream_options={"include_usage": True}, **extra))
        assert e.value.param == "stream_options"
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage


@pytest.mark.parametrize("prompt", ["x", ["a", "b"], [1, 2], [[1, 2], [3]]])
def test_prompt_forms(prompt) -> None:
    assert parse_request(CompletionRequest, {"prompt": prompt}).prompt == prompt


@pytest.mark.parametrize("field,value,param", [
    ("temperature", -1, "temperature"), ("top_p", 0, "top_p"), ("n", 0, "n"), ("n", 1000, "n"),
    ("max_tokens", -1, "max_tokens"), ("max_completion_tokens", 0, "max_completion_tokens"),
    ("top_logprobs", 50, "top_logprobs"), ("stop", [""], "stop"), ("stop_token_ids", [-1], "stop_token_ids"),
])
def test_out_of_range_values_name_the_field(field, value, param) -> None:
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    with pytest.raises(InvalidRequest) as ei:
        to_sampling_params(chat(**{field: value}, **extra))
    assert ei.value.param == param
    if param in ("max_tokens", "max_completion_tokens"):   # the message names the field as the client sent it
        assert f"'{param}'" in ei.value.message and f"'{param}'" in str(ei.value)


@pytest.mark.parametrize("body,param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": MSGS, "temperature": "hot"}, "temperature"),
    ({"messages": MSGS, "temperature": float("nan")}, "temperature"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": []}, "messages"),
    ({}, "messages"),
])
def test_type_errors_are_invalid_request(body, param) -> None:
    with pytest.raises(InvalidRequest) as ei:
        parse_request(ChatCompletionRequest, body)
    assert ei.value.param == param


def test_chunk_shape_keeps_null_finish_reason_and_drops_empty_delta_fields() -> None:
    c = ChatCompletionChunk(id="x", created=1, model="m",
                            choices=[ChatCompletionStreamChoice(index=0, delta=DeltaMessage(content="a"))])
    assert chunk_json(c, include_usage=False) == (
        '{"id":"x","object":"chat.completion.chunk","created":1,"model":"m",'
        '"choices":[{"index":0,"delta":{"content":"a"},"logprobs":null,"finish_reason":null}]}')
    assert '"usage":null' in chunk_json(c, include_usage=True)


def test_completions_boolean_logprobs_are_lenient() -> None:
    assert to_sampling_params(parse_request(CompletionRequest, {"prompt": "x", "logprobs": False})).logprobs is None
    assert to_sampling_params(parse_request(CompletionRequest, {"prompt": "x", "logprobs": True})).logprobs == 1
