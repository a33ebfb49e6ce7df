"""Grammar-constrained decoding in the engine: one llguidance matcher per constrained request, one token mask
per step for the batch, the matcher advanced after each accepted token.

The frontend turns a request's ``response_format`` / ``structured_outputs`` / forced tool call into an llguidance
grammar string (``ferrylm.server.text.structured``) and sends it as ``SamplingParams.grammar``; the engine only
compiles and runs it. Three calls, made by :class:`ferrylm.engine.engine.Engine`:

- :meth:`StructuredDecoder.attach` at admission: builds the request's matcher (``Request.grammar``); raises
  InvalidRequest for a grammar that does not compile against this vocabulary.
- :meth:`StructuredDecoder.mask_logits` before sampling: fills a ``[B, ceil(V/32)]`` int32 bitmask for the
  constrained rows (llguidance, in parallel threads, GIL released; other rows all ones), unpacks it and sets every
  forbidden logit to ``-inf`` with one ``masked_fill_`` on the batched ``[B, V]`` tensor. No Python loop over the
  vocabulary; a step without constrained rows costs one pass over the request list.
- :meth:`StructuredDecoder.advance` after a token is appended: the matcher consumes it.

Library choice (docs/API.md has the measured table): llguidance compiles lazily, imports without torch (so the
frontend validates grammars with the same library, 400 before admission) and has no dependencies; xgrammar needs
torch and compiles each schema up front; outlines-core handles regular languages only.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

import torch

from ferrylm.errors import InvalidRequest

log = logging.getLogger("ferrylm.engine")

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[k, ceil(V/32)]`` int32 bitmask (bit j of word w = token ``32 w + j`` allowed) → ``[k, vocab]`` bool."""
    dev = bitmask.device
    shifts = _SHIFTS.get(dev)
    if shifts is None:
        shifts = _SHIFTS[dev] = torch.arange(32, dtype=torch.int32, device=dev)
    bits = (bitmask[:, :, None] >> shifts) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)
    if allowed.shape[1] < vocab:   # logits wider than the mask: the extra ids are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    return allowed[:, :vocab].bool()


class StructuredDecoder:
    """Compiles and runs the grammars of constrained requests.

    Args:
        tokenizer_path: the model folder (its tokenizer is loaded on the first constrained request, ~1 s for a
            150k vocabulary); None: constrained requests are refused (InvalidRequest).
        vocab_size: width of the model's logits (may exceed the tokenizer's vocabulary: those ids are never
            allowed by a grammar).
        eos_ids: the token ids that end a request; a grammar that is complete allows exactly these.
    """

    def __init__(self, tokenizer_path: str | os.PathLike | None, vocab_size: int, eos_ids: Sequence[int]):
        self.tokenizer_path = None if tokenizer_path is None else os.fspath(tokenizer_path)
        self.vocab_size = int(vocab_size)
        self.eos_ids = [int(t) for t in eos_ids]
        self._tokenizer: Any = None
        self._executor: Any = None

    # ---- setup ------------------------------------------------------------------------------------------
    def _ll_tokenizer(self) -> Any:
        if self._tokenizer is None:
            if self.tokenizer_path is None:
                raise InvalidRequest("structured output needs the model's tokenizer, and this engine has none")
            import llguidance
            import llguidance.hf
            from transformers import AutoTokenizer, PreTrainedTokenizerFast

            path = self.tokenizer_path
            if path.lower().endswith(".gguf") and os.path.isfile(path):
                from ferrylm.checkpoints.gguf_tokenizer import gguf_tokenizer

                hf = gguf_tokenizer(path)
            elif os.path.isfile(os.path.join(path, "tokenizer.json")):
                hf = PreTrainedTokenizerFast.from_pretrained(path)
            else:
                hf = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
            eos = self.eos_ids or hf.eos_token_id
            self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=eos)
            self._executor = llguidance.LLExecutor(num_threads=min(4, os.cpu_count() or 1))
            log.info("structured output: llguidance %s tokenizer for %s (%d ids)", llguidance.__version__, path,
                     self.vocab_size)
        return self._tokenizer

    # ---- the three hooks --------------------------------------------------------------------------------
    def attach(self, req: Any) -> None:
        """Build ``req.grammar`` (an ``llguidance.LLMatcher``) from ``req.params.grammar``; no-op without one.

        Raises:
            InvalidRequest: the grammar does not compile (param ``grammar``), or there is no tokenizer.
        """
        spec = getattr(req.params, "grammar", None)
        if not spec:
            return
        import llguidance

        matcher = llguidance.LLMatcher(self._ll_tokenizer(), spec, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"the structured-output grammar is invalid: {matcher.get_error()}",
                                 param="grammar")
        req.grammar = matcher

    def mask_logits(self, logits: torch.Tensor, reqs: Sequence[Any]) -> None:
        """Set the logits of tokens the grammar of ``reqs[i]`` forbids to ``-inf`` in row i (in place).

        One ``[B, ceil(V/32)]`` bitmask for the batch (rows without a grammar stay all-ones), filled by
        llguidance's parallel executor, unpacked (numpy on the CPU, torch on the logits' device otherwise) and
        applied with a single ``masked_fill_`` over ``[B, V]``. Returns at once when no row is constrained.

        Args:
            logits: ``[B, V]`` float logits, row i for ``reqs[i]``.
            reqs: the B requests.
        """
        rows = [i for i, r in enumerate(reqs) if getattr(r, "grammar", None) is not None]
        if not rows:
            return
        import numpy as np
        from llguidance.numpy import fill_next_token_bitmask_par

        B, V = logits.shape
        words = (max(V, self.vocab_size) + 31) // 32
        bitmask = np.full((B, words), -1, dtype=np.int32)
        fill_next_token_bitmask_par(self._executor, [(reqs[i].grammar, i) for i in rows], bitmask)
        for i in rows:
            m = reqs[i].grammar
            if m.is_error():   # e.g. a schema that matches no document: no token is allowed; the engine ends it
                reqs[i].grammar_error = f"the output grammar allows no next token ({m.get_error()})"
        if logits.device.type == "cpu":   # numpy's unpackbits: far cheaper than torch's shifts
            forbid = torch.from_numpy(np.unpackbits((~bitmask).view(np.uint8), axis=1, bitorder="little")[:, :V]
                                      .view(np.bool_))
        else:
            forbid = ~unpack_bitmask(torch.from_numpy(bitmask).to(logits.device, non_blocking=True), V)
        logits.masked_fill_(forbid, float("-inf"))

    def advance(self, req: Any, token_id: int) -> str | None:
        """Let ``req``'s matcher consume ``token_id`` (the token just appended). Returns None, or the reason the
        grammar cannot go on: a token it rejects (only possible when another rule banned every allowed token,
        e.g. ``min_tokens`` against ``stop_token_ids`` the grammar needs), or a mask that allowed nothing
        (``mask_logits``). The engine then ends the request with ``grammar_failed``: it never goes on
        unconstrained. The step itself never fails."""
        m = getattr(req, "grammar", None)
        if m is None:
            return None
        err = getattr(req, "grammar_error", None)
        if err:
            return err
        if m.is_stopped() and token_id in self.eos_ids:
            return None
        if not m.consume_token(int(token_id)):
            err = f"token {token_id} is outside the output grammar ({m.get_error() or 'rejected'})"
            log.warning("request %s: %s; the request ends with grammar_failed", getattr(req, "request_id", "?"), err)
            req.grammar = None
            return err
        return None
