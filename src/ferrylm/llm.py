"""Offline API: ``LLM(model).generate(prompts, SamplingParams)`` runs an in-process engine over many prompts.

The same engine as ``ferry serve`` (continuous batching, paged KV), without the HTTP layer or a second process.
Text is produced with the frontend's incremental detokenizer and stop-string logic, so results match the server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from ferrylm.config import EngineConfig
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.errors import ContextLengthExceeded, InvalidRequest

if TYPE_CHECKING:
    from ferrylm.checkpoints.resolve import ResolvedModel


@dataclass
class CompletionOutput:
    """One choice: ``text``, ``token_ids`` generated, ``finish_reason`` ("stop" | "length")."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list | None = None


@dataclass
class RequestOutput:
    """All choices of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


class LLM:
    """An in-process engine.

    Args:
        model: built-in name, HF folder, .gguf file or ``synthetic:`` spec (as ``--model``), or a ResolvedModel
            (``checkpoints/resolve.py``) when the caller has resolved it already.
        engine_config: an EngineConfig (default: EngineConfig()).

    A synthetic model without a tokenizer has ``codec`` None: prompts must be token-id lists, outputs have token
    ids and empty text.

    Raises:
        ModelLoadError: the model cannot be resolved or loaded.
    """

    def __init__(self, model: "str | ResolvedModel" = "smollm2-moe", *, engine_config: EngineConfig | None = None,
                 **overrides):
        from ferrylm.engine.boot import build_engine
        from ferrylm.checkpoints.resolve import ResolvedModel, resolve_model
        from ferrylm.server.text.harmony import load_codec

        cfg = engine_config or EngineConfig()
        if overrides:
            from dataclasses import replace

            cfg = replace(cfg, **overrides)
        self.resolved = model if isinstance(model, ResolvedModel) else resolve_model(model)
        self.codec = load_codec(self.resolved.path) if self.resolved.has_tokenizer else None
        self.engine = build_engine(self.resolved.path, cfg)
        self._counter = 0

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | None = None) -> list[RequestOutput]:
        """Generate for every prompt (strings are tokenized with the model's tokenizer; lists are token ids).

        Returns one RequestOutput per prompt, in order. Raises InvalidRequest / ContextLengthExceeded when a
        prompt cannot be served.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        encoded = []
        for p in prompts:
            if isinstance(p, str):
                # the offline API's prompts are the operator's own: chat markup in them is meant
                encoded.append((p, self._require_codec().encode(p, parse_special=True)))
            else:
                encoded.append((None, [int(t) for t in p]))
        return self._run(encoded, params or SamplingParams())

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]], params: SamplingParams | None = None, *,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Like :meth:`generate` with each conversation rendered by the model's chat template.

        ``messages``: one conversation (a list of ``{"role", "content"}`` dicts, vLLM's usual form:
        ``llm.chat([{"role": "user", "content": "Hi"}], params)``) or a list of conversations; one
        RequestOutput per conversation either way.

        Raises:
            InvalidRequest: ``messages`` is neither form (``param: messages``).
        """
        codec = self._require_codec()
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise InvalidRequest("'messages' must be a conversation (a list of message dicts) or a list of them",
                                 param="messages")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        for i, conv in enumerate(conversations):
            if isinstance(conv, (str, bytes)) or not isinstance(conv, Sequence) or not conv or \
                    not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in conv):
                raise InvalidRequest(f"conversation {i} must be a non-empty list of message dicts with a 'role'",
                                     param="messages")
        encoded = [(None, codec.apply_chat_template(list(c), add_generation_prompt=add_generation_prompt))
                   for c in conversations]
        return self._run(encoded, params or SamplingParams())

    def _require_codec(self):
        if self.codec is None:
            raise InvalidRequest(f"model {self.resolved.name} has no tokenizer: pass token ids, or name a "
                                 f"tokenizer folder (--tokenizer / :tokenizer=FOLDER)", param="prompt")
        return self.codec

    def _run(self, encoded: list[tuple[str | None, list[int]]], params: SamplingParams) -> list[RequestOutput]:
        from copy import deepcopy

        from ferrylm.engine.admission import admit
        from ferrylm.engine.outputs import EngineOutput
        from ferrylm.server.text.text_stream import TextStream

        params.validate()
        if self.codec is None and params.stop:
            raise InvalidRequest("stop strings need a tokenizer; this model has none (use stop_token_ids)",
                                 param="stop")
        limits = self.engine.limits
        for _, ids in encoded:   # the typed error, naming its field, before any request starts (as the server)
            admit(len(ids), params.max_tokens, max_model_len=limits.max_model_len, pool_tokens=limits.pool_tokens)
        results: list[RequestOutput] = []
        streams: dict[str, tuple[CompletionOutput, TextStream | None]] = {}
        for text, ids in encoded:
            self._counter += 1
            ro = RequestOutput(f"offline-{self._counter}", text, ids)
            results.append(ro)
            for i in range(params.n):
                rid = f"{ro.request_id}-{i}"
                p = deepcopy(params)
                p.n = 1
                if p.seed is not None:
                    p.seed += i
                co = CompletionOutput(i, "", [], None)
                ro.outputs.append(co)
                streams[rid] = (co, None if self.codec is None else TextStream(
                    self.codec, ids, stop=p.stop, include_stop_str_in_output=p.include_stop_str_in_output,
                    skip_special_tokens=p.skip_special_tokens))
                self.engine.add_request(rid, ids, p)
        while self.engine.has_work():
            for out in self.engine.step():
                out: EngineOutput
                co, ts = streams[out.request_id]
                if out.error_code:
                    cls = ContextLengthExceeded if out.error_code == "context_length_exceeded" else InvalidRequest
                    for rid in streams:
                        self.engine.abort(rid)
                    self.engine.step()
                    raise cls(out.error_message or out.error_code)
                if co.finish_reason is not None:
                    continue
                co.token_ids.extend(out.new_token_ids)
                if out.logprobs:
                    co.logprobs = (co.logprobs or []) + out.logprobs
                if ts is None:  # token ids only
                    co.finish_reason = out.finish_reason
                    continue
                ts.add(out.new_token_ids)
                if ts.stopped:
                    co.finish_reason = "stop"
                    self.engine.abort(out.request_id)
                elif out.finish_reason is not None:
                    ts.finish()
                    co.finish_reason = out.finish_reason
                co.text = ts.text
        return results
