"""POST /v1/completions (the legacy text-completion API, vLLM's extensions included): prompts as text or token
ids (up to ``MAX_PROMPTS_PER_REQUEST``), echo with or without prompt logprobs, ``max_tokens: 0`` with echo (score
the prompt only), ``prompt_logprobs`` / ``return_token_ids``, streaming. :class:`CompletionRoutes` is a mixin of
the app's ``_Server`` (server/api/app.py): it uses the server's codec, checks, admission (``_start``) and logging.

This module must not import torch.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from ferrylm.engine.outputs import TokenLogprob
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.errors import InvalidRequest
from ferrylm.server.api.chat import DONE as _DONE, SSE_HEADERS as _SSE_HEADERS
from ferrylm.server.api.chat import off_loop as _off_loop
from ferrylm.server.api.completions_logprobs import echo_logprobs, join_logprobs, vllm_prompt_logprobs
from ferrylm.server.api.generation import PING, SSE_PING, Choice, Generation, SSEResponse, sse_event
from ferrylm.server.api.prepare import (check_param_ids, check_prompt_chars, check_token_ids, fit_context,
                                         make_choices)
from ferrylm.server.api.chat_protocol import (CompletionChoice, CompletionRequest, CompletionResponse,
                                              completion_logprobs, to_sampling_params)
from ferrylm.server.api.protocol import UsageInfo, chunk_json, parse_request
from ferrylm.server.api.request_io import ARRIVAL_KEY, read_json
from ferrylm.server.text.harmony import open_message
from ferrylm.server.text.harmony_grammar import harmony_output_grammar, prompt_position
from ferrylm.server.text.structured import request_grammar

MAX_PROMPTS_PER_REQUEST = 64  # a list of prompts


@dataclasses.dataclass
class PreparedCompletion:
    """A completions request checked, not started: ``req`` (``max_tokens`` 0 with echo already turned into 1),
    its sampling parameters, the token ids, echo text and ``max_tokens`` of each prompt, and the two echo
    switches: ``prompt_only`` (score the prompt, generate nothing) and ``echo_logprobs``."""

    req: CompletionRequest
    params: SamplingParams
    prompts: list[list[int]]
    echo_texts: list[str]
    max_tokens: list[int]
    prompt_only: bool
    echo_logprobs: bool



class CompletionRoutes:
    """The completions route's methods (module docstring)."""

    def _completion_prompts(self, req: CompletionRequest) -> tuple[list[list[int]], list[str]]:
        """Token ids and echo text of each prompt. Raises InvalidRequest for empty or out-of-vocab prompts."""
        p = req.prompt
        if isinstance(p, str):
            items: list[Any] = [p]
        elif not p:
            raise InvalidRequest("'prompt' must not be empty", param="prompt")
        elif isinstance(p[0], int):
            items = [p]
        else:
            items = list(p)
        if len(items) > MAX_PROMPTS_PER_REQUEST:
            raise InvalidRequest(f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request, got {len(items)}",
                                 param="prompt")
        ids_list, texts = [], []
        for item in items:
            if isinstance(item, str):
                check_prompt_chars(self.codec, len(item), self.engine.model_info, what="prompt", param="prompt")
                ids_list.append(self.codec.encode(item))
                texts.append(item)
            else:
                ids = [int(t) for t in item]
                check_token_ids(self.codec, ids, "prompt")
                ids_list.append(ids)
                texts.append(self.codec.decode(ids, skip_special_tokens=False) if req.echo else "")
        return ids_list, texts

    async def prepare_completion(self, req: CompletionRequest) -> PreparedCompletion:
        """Everything a completions request goes through before the engine: sampling parameters and output
        grammar, the prompts' token ids (checked), the context check of each. Used by the completions route and
        its render route (server/api/render.py), so both see the same prompts.

        Raises:
            InvalidRequest / ContextLengthExceeded: a field's value, an empty or out-of-vocabulary prompt, too
                long (400, naming the field).
        """
        prompt_only = req.requested_max_tokens == 0   # echo + max_tokens 0: score the prompt, generate nothing
        if prompt_only:
            if not req.echo:
                raise InvalidRequest("'max_tokens' 0 is only allowed with 'echo' (prompt logprobs only)",
                                     param="max_completion_tokens" if req.max_completion_tokens is not None
                                     else "max_tokens")
            req = req.model_copy(update={"max_tokens": 1, "max_completion_tokens": None})
        params = to_sampling_params(req)
        params.grammar, grammar_param = await _off_loop(request_grammar, req)
        check_param_ids(self.codec, params)
        if req.suffix:
            raise InvalidRequest("'suffix' is not supported", param="suffix")
        echo_lp = bool(req.echo) and params.logprobs is not None
        if echo_lp:   # the echoed prompt carries its logprobs: ask the engine for them
            params.prompt_logprobs = max(params.logprobs or 0, params.prompt_logprobs or 0)
        prompts, echo_texts = await _off_loop(self._completion_prompts, req)
        if self.chat_format.harmony is not None and params.grammar is not None:
            params.grammar = await _off_loop(self._harmony_grammar, params.grammar, grammar_param, prompts)
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = [fit_context(self.engine.model_info, ids, params, default_max=16, what="prompt",
                                  prompt_param="prompt", max_param=max_param) for ids in prompts]
        return PreparedCompletion(req, params, prompts, echo_texts, max_tokens, prompt_only, echo_lp)

    def _harmony_grammar(self, answer: str, param: str, prompts: list[list[int]]) -> str:
        """A gpt-oss model's output constraint for token prompts that end in an open harmony message: it holds
        for the final message (``server/text/harmony_grammar.py``); the same for every prompt, so they must
        leave the turn at the same place. Raises InvalidRequest (``prompt``) when they do not."""
        positions = {prompt_position(self.chat_format.harmony, open_message(ids)) for ids in prompts}
        if len(positions) > 1:
            raise InvalidRequest(f"'{param}' holds for the final message of a harmony turn, and these prompts leave "
                                 f"the turn at different places ({', '.join(sorted(positions))}); send them "
                                 f"separately", param="prompt")
        return harmony_output_grammar(answer, positions.pop(), param, term=self.chat_format.tool_term)

    async def _completion(self, request: Request, rid: str) -> Response:
        req: CompletionRequest = parse_request(CompletionRequest, await read_json(request))
        model = self.check_model(req.model)
        prep = await self.prepare_completion(req)
        req, params, prompts, echo_texts, max_tokens = prep.req, prep.params, prep.prompts, prep.echo_texts, \
            prep.max_tokens
        prompt_only, echo_lp = prep.prompt_only, prep.echo_logprobs
        self._log_request(rid, "completion", prompts, max_tokens, params, bool(req.stream), req.unknown_fields())
        self._check_ready()
        base_id = f"cmpl-{uuid.uuid4().hex}"
        choices = make_choices(self.codec, self.engine.model_info, self.chat_format.harmony, base_id, prompts,
                               max_tokens, params)
        gen = Generation(self.engine, rid, choices, metrics=self.metrics, arrival=request.scope.get(ARRIVAL_KEY),
                         timeout_s=self._timeout(request))
        shape = CompletionShape(self, req, echo=[echo_texts[ch.index // params.n] if req.echo else ""
                                                  for ch in gen.choices],
                                 echo_logprobs=echo_lp, prompt_only=prompt_only)
        prompt_tokens = sum(len(p) for p in prompts)
        created = int(time.time())
        await self._start(request, rid, gen, bool(req.stream))
        if req.stream:
            return SSEResponse(self._completion_stream(rid, gen, base_id, created, model, prompt_tokens, shape, req),
                               headers=_SSE_HEADERS)
        await gen.close()
        choices = []
        for ch in gen.choices:
            c = shape.head(ch)
            if not prompt_only:
                c.text += ch.text.text
                if ch.params.logprobs is not None:
                    c.logprobs = shape.joined(c.logprobs, completion_logprobs(
                        ch.logprobs, [o + len(shape.echo[ch.index]) for o in ch.offsets], self.codec,
                        ch.params.logprobs))
                if req.return_token_ids:
                    c.token_ids = list(ch.token_ids)
            c.finish_reason = ch.finish_reason
            choices.append(c)
        usage = UsageInfo.of(prompt_tokens, shape.completion_tokens(gen), gen.cached_tokens)
        self.log_done(rid, gen, usage)
        resp = CompletionResponse(id=base_id, created=created, model=model, choices=choices, usage=usage)
        return Response(resp.model_dump_json(), media_type="application/json")

    async def _completion_stream(self, rid: str, gen: Generation, base_id: str, created: int, model: str,
                                 prompt_tokens: int, shape: "CompletionShape",
                                 req: CompletionRequest) -> AsyncIterator[str]:
        include_usage, continuous = req.include_usage, req.continuous_usage

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            if usage is None and continuous and choices:
                usage = UsageInfo.of(prompt_tokens, shape.completion_tokens(gen), gen.cached_tokens)
            c = CompletionResponse(id=base_id, created=created, model=model, choices=choices, usage=usage)
            return sse_event(chunk_json(c, include_usage=include_usage or continuous))

        pending: dict[int, tuple[list[TokenLogprob], list[int], list[int]]] = {}
        started: set[int] = set()
        try:
            if self.ping_interval:   # the first byte goes out with the headers
                yield SSE_PING
            if not shape.waits_for_engine:   # the echo (and the prompt ids) go out at once
                for ch in gen.choices:
                    head = shape.head(ch)
                    started.add(ch.index)
                    if head.text or head.prompt_token_ids is not None:
                        yield chunk([head])
            ev: Any = await gen.next_or_ping(self.ping_interval)
            while ev is not None:
                if ev is PING:
                    yield SSE_PING
                    ev = await gen.next_or_ping(self.ping_interval)
                    continue
                ch = gen.choices[ev.index]
                out: list[CompletionChoice] = []
                if ev.index not in started:   # echo with prompt logprobs: they came with the first output
                    started.add(ev.index)
                    out.append(shape.head(ch))
                lps, offs, ids = pending.setdefault(ev.index, ([], [], []))
                if not shape.prompt_only:
                    lps.extend(ev.logprobs or ())
                    offs.extend(o + len(shape.echo[ev.index]) for o in (ev.offsets or ()))
                    ids.extend(ev.token_ids)
                text = "" if shape.prompt_only else ev.text
                if text or ev.finish_reason is not None:
                    logprobs = None
                    if ch.params.logprobs is not None and not shape.prompt_only:
                        logprobs = completion_logprobs(lps, offs, self.codec, ch.params.logprobs)
                    out.append(CompletionChoice(index=ev.index, text=text, logprobs=logprobs,
                                                finish_reason=ev.finish_reason,
                                                token_ids=list(ids) if req.return_token_ids else None))
                    pending[ev.index] = ([], [], [])
                if len(out) == 2 and not out[1].text and out[1].logprobs is None and out[1].token_ids is None:
                    out[0].finish_reason, out = out[1].finish_reason, out[:1]   # one chunk: echo + finish
                for c in out:
                    yield chunk([c])
                ev = await gen.next_or_ping(self.ping_interval)
            usage = UsageInfo.of(prompt_tokens, shape.completion_tokens(gen), gen.cached_tokens)
            if include_usage:
                yield chunk([], usage)
            self.log_done(rid, gen, usage)
            yield _DONE
        except Exception as e:  # noqa: BLE001
            yield self.stream_error(rid, e)
            yield _DONE
        finally:
            await gen.close()


@dataclasses.dataclass
class CompletionShape:
    """How a completions request's choices begin: the echoed prompt (with its logprobs when asked, which arrive
    with the engine's first output), vLLM's ``prompt_logprobs`` and ``prompt_token_ids``; ``prompt_only``
    (``max_tokens: 0``) drops the one token the engine generated."""

    server: Any
    req: CompletionRequest
    echo: list[str]
    echo_logprobs: bool
    prompt_only: bool

    @property
    def waits_for_engine(self) -> bool:
        return self.echo_logprobs or self.req.prompt_logprobs is not None

    def head(self, ch: Choice) -> CompletionChoice:
        codec = self.server.codec
        c = CompletionChoice(index=ch.index, text=self.echo[ch.index])
        plps = ch.prompt_logprobs or []
        if self.echo_logprobs:
            c.logprobs = echo_logprobs(codec, ch.prompt_ids, plps, ch.params.logprobs or 0)
        if self.req.prompt_logprobs is not None:
            c.prompt_logprobs = vllm_prompt_logprobs(codec, ch.prompt_ids, plps)
        if self.req.return_token_ids:
            c.prompt_token_ids = list(ch.prompt_ids)
        return c

    def joined(self, head: Any, tail: Any) -> Any:
        return join_logprobs(head, tail) if head is not None else tail

    def completion_tokens(self, gen: Generation) -> int:
        return 0 if self.prompt_only else gen.completion_tokens
