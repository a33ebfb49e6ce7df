"""A request made ready for the engine, before anything runs.

- the served :class:`~ferrylm.server.api.chat_format.ChatFormat` (``chat_format.py``) says how a chat turn is
  rendered and read.
- :func:`prepare_chat`: a chat-like request (chat completions, Anthropic Messages, the Responses API, their render
  routes) through the forced-call grammar, the template, the token-id checks and the context check.
- :func:`turn_config`: how a chat turn's output is read (reasoning, tool calls, harmony channels).
- :func:`make_choices`: the engine requests of any generating route, one per prompt and ``n``.

This module must not import torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from ferrylm.engine.admission import admit
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.errors import ContextLengthExceeded, InvalidRequest
from ferrylm.server.api.assistant import TurnConfig
from ferrylm.server.api.chat import off_loop, render_prompt
from ferrylm.server.api.chat_format import ChatFormat
from ferrylm.server.api.context import ChatJob, PreparedChat
from ferrylm.server.api.generation import Choice
from ferrylm.server.process.engine_client import ModelInfo
from ferrylm.server.text.harmony import HarmonyCodec, open_message
from ferrylm.server.text.harmony_grammar import harmony_output_grammar, prompt_position
from ferrylm.server.text.harmony_reader import HarmonyTextStream
from ferrylm.server.text.reasoning import THINKING_SWITCHES, prompt_opens_thinking
from ferrylm.server.text.text_stream import TextPipeline, TextStream
from ferrylm.server.text.tokenizer import TextCodec


def check_token_ids(codec: TextCodec, ids: Sequence[int], param: str) -> None:
    """Raise InvalidRequest naming ``param`` when an id of ``ids`` is outside ``codec``'s vocabulary."""
    vocab = codec.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is out of range [0, {vocab})", param=param)


def check_param_ids(codec: TextCodec, params: SamplingParams) -> None:
    """Raise InvalidRequest when ``stop_token_ids`` or ``logit_bias`` names a token outside the vocabulary."""
    check_token_ids(codec, params.stop_token_ids, "stop_token_ids")
    check_token_ids(codec, [int(t) for t, _ in params.logit_bias], "logit_bias")


def check_prompt_chars(codec: TextCodec, chars: int, info: ModelInfo, *, what: str, param: str) -> None:
    """Refuse, before tokenizing it, a prompt of ``chars`` characters that cannot fit the context whatever its
    tokens: even at the longest vocabulary entry per token (halved, for a normalizer that composes characters) it
    exceeds ``max_model_len``. Tokenizing megabytes only to refuse them costs seconds of CPU.

    Raises:
        ContextLengthExceeded: naming ``param``.
    """
    limit = int(info.max_model_len)
    fewest = chars // (2 * codec.longest_token)
    if fewest >= limit:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {limit} tokens. However, the {chars} characters of your {what} "
            f"make at least {fewest} tokens, which leaves no room for the completion. Please reduce the length of the "
            f"{what} (the limit is the server's --max-model-len, at most the model's own context).", param=param)


def fit_context(info: ModelInfo, prompt_ids: list[int], params: SamplingParams, *, default_max: int | None,
                what: str, prompt_param: str, max_param: str) -> int:
    """The request's max_tokens (:func:`ferrylm.engine.admission.admit` over the engine's limits ``info``), or
    ContextLengthExceeded / InvalidRequest."""
    return admit(len(prompt_ids), params.max_tokens, max_model_len=int(info.max_model_len),
                 pool_tokens=int(info.kv_pool_tokens or 0), default_max=default_max, what=what,
                 prompt_param=prompt_param, max_param=max_param)


async def prepare_chat(fmt: ChatFormat, codec: TextCodec, info: ModelInfo, job: ChatJob) -> PreparedChat:
    """Everything a chat-like request goes through before the engine: the forced-call grammar, the template
    (tools native or the fallback), the token ids checked, the context check (``info``: the engine's limits).
    ``job.params`` is updated in place (grammar, ``skip_special_tokens``). The app's ``run_chat`` and the render
    routes (server/api/render.py) both use it, so both see the same prompt.

    Raises:
        InvalidRequest / ContextLengthExceeded: bad messages, template errors, too long (400).
    """
    answer = job.params.grammar   # the request's own constraint (a forced call's grammar is set below)
    await off_loop(job.apply_tool_choice, fmt.tool_tags, fmt.tool_parser, fmt.tool_term)
    if job.params.grammar is not None and fmt.reasoning:
        # a constrained output starts at its first token: a template that thinks first is told not to (Qwen3's
        # switch, DeepSeek-V3.1's), unless the client said otherwise
        job.template_kwargs = {**{k: False for k in THINKING_SWITCHES}, **job.template_kwargs}
    check_prompt_chars(codec, sum(len(m["content"]) for m in job.messages if isinstance(m.get("content"), str)),
                       info, what="messages", param=job.prompt_param)
    text, prompt_ids = await off_loop(render_prompt, codec, job, native_tools=fmt.native_tools,
                                      tool_format=fmt.tool_parser)
    params = job.params
    if fmt.harmony is not None and answer is not None:   # it holds for the final message (harmony_grammar.py)
        calls = job.tools if job.tool_choice.mode == "auto" else None
        params.grammar = await off_loop(harmony_output_grammar, answer,
                                        prompt_position(fmt.harmony, open_message(prompt_ids)),
                                        job.grammar_param or "response_format", tools=calls, term=fmt.tool_term)
    params.stop_token_ids += [t for t in codec.stop_token_ids if t not in params.stop_token_ids]
    tools_on = bool(job.tools) and job.tool_choice.mode != "none"
    if (fmt.special_tool_markup and tools_on) or fmt.special_think_markup:
        params.skip_special_tokens = False  # as vLLM's glm45 / minimax_m2 parsers do (EOS ids stay out anyway)
    check_param_ids(codec, params)
    max_tokens = fit_context(info, prompt_ids, params, default_max=None, what=job.prompt_param,
                             prompt_param=job.prompt_param, max_param=job.max_param)
    return PreparedChat(text, prompt_ids, max_tokens)


def _message_text(message: Any) -> str:
    """A template message's text content ("" for none): a string, or the text parts of a list."""
    c = message.get("content") if isinstance(message, dict) else None
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        return "".join(p.get("text", "") for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def turn_config(fmt: ChatFormat, job: ChatJob, text: str, prime: tuple[int, ...] | None) -> TurnConfig:
    """How the output of prepared ``job`` (prompt ``text``; ``prime``: a harmony turn's open message) is read."""
    params = job.params
    tools = tuple(t.name for t in job.tools) if job.tools and job.tool_choice.mode != "none" else None
    prefill = _message_text(job.messages[-1]) if job.continue_final_message and job.messages else None
    # a grammar constrains the output from its first token, so it is never reasoning, even after a prompt
    # that opened <think> (an R1 template always does; a client may turn thinking on for a forced call)
    return TurnConfig(reasoning=fmt.reasoning, starts_in_reasoning=fmt.reasoning and params.grammar is None
                      and prompt_opens_thinking(text, prefill), tool_names=tools, tool_parser=fmt.tool_parser,
                      tool_schemas={t.name: t.parameters for t in job.tools} if tools else None,
                      forced=bool(tools) and job.tool_choice.forced, harmony=fmt.harmony,
                      max_calls=None if job.tool_choice.parallel else 1, harmony_prime=prime or ())


def _choice_seed(seed: int, i: int) -> int:
    """Choice ``i``'s seed: ``seed + i``, wrapped into the valid int64 range [-2**63, 2**63) (a client's seed near
    the top of the range must not make choice 1 out of range)."""
    s = seed + i
    return s - 2**64 if s >= 2**63 else s


def make_choices(codec: TextCodec, info: ModelInfo, harmony: HarmonyCodec | None, base_id: str,
                 prompts: list[list[int]], max_tokens: list[int], params: SamplingParams,
                 harmony_prime: tuple[int, ...] | None = None) -> list[Choice]:
    """One :class:`Choice` per prompt and ``n`` (engine request id ``base_id``, or ``{base_id}-{i}`` when there are
    several; ``info``: the engine's EOS ids). ``harmony_prime``: a harmony chat turn's open message (its text is the
    messages' text, stop strings inside one message: ``HarmonyTextStream``), None for text."""
    n = params.n
    total = len(prompts) * n
    skip_ids = frozenset(info.eos_token_ids) | frozenset(codec.eos_token_ids) | frozenset(params.stop_token_ids)
    choices = []
    for pi, ids in enumerate(prompts):
        for i in range(n):
            idx = pi * n + i
            p = dataclasses.replace(params, n=1, max_tokens=max_tokens[pi],
                                    seed=None if params.seed is None else _choice_seed(params.seed, i),
                                    stop=list(params.stop), stop_token_ids=list(params.stop_token_ids))
            p.validate()
            if harmony_prime is not None and harmony is not None:
                text: TextPipeline = HarmonyTextStream(harmony, harmony_prime, stop=p.stop,
                                                     include_stop_str_in_output=p.include_stop_str_in_output)
            else:
                text = TextStream(codec, ids, stop=p.stop, skip_special_tokens=p.skip_special_tokens,
                                  include_stop_str_in_output=p.include_stop_str_in_output)
            choices.append(Choice(idx, base_id if total == 1 else f"{base_id}-{idx}", ids, p, text, skip_ids))
    return choices
