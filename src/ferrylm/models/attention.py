"""The contract between model code and the KV cache.

Model code never owns KV memory. Each forward pass receives an :class:`AttentionBackend` that, for one layer,
stores the new keys/values and returns the attention output for the batch's query tokens. The engine passes a
paged implementations (``engine/attention/``); tests and reference runs use the one-sequence backends of
:mod:`ferrylm.models.reference_attention`.

Batch layout (the "flattened" layout of vLLM / SGLang): all query tokens of all sequences in the step are
concatenated along dim 0, so ``q`` is ``[T, num_heads, head_dim]`` with ``T`` the step's total new tokens.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionBackend(Protocol):
    """Stores K/V for a layer and computes causal attention for the step's tokens."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float, *, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of the step's query tokens over their sequences' cached + new K/V.

        Args:
            layer_idx: decoder layer index (0-based).
            q: ``[T, num_heads, head_dim]`` queries, RoPE applied.
            k: ``[T, num_kv_heads, head_dim]`` new keys, RoPE applied (stored by the call).
            v: ``[T, num_kv_heads, head_dim]`` new values (stored by the call).
            scale: softmax scale (usually ``head_dim ** -0.5``).
            window: sliding window: a query at position ``p`` sees the keys at ``p - window < j <= p`` only
                (``window`` tokens, itself included; transformers' ``sliding_window``); None = every earlier key.
            sinks: ``[num_heads]`` float32 attention-sink logits (gpt-oss): one more softmax entry per query row
                that carries no value, so the output is scaled by ``1 / (1 + exp(sink - logsumexp(scores)))``; None
                = no sink.

        Returns:
            ``[T, num_heads, head_dim]`` attention output. GQA: query head h reads kv head
            ``h // (num_heads // num_kv_heads)``.
        """
        ...

    # Backends of models with multi-head latent attention (DeepSeek-V3) also implement:
    #   attend_latent(layer_idx, q_nope [T, H, N], q_pe [T, H, P], c_kv [T, R], k_pe [T, P],
    #                 proj: LatentProjection, scale) -> [T, H, V]
    # storing ``[c_kv ; k_pe]`` per token and returning the attention output per head
    # (``models/latent_attention.py`` has the contract and the math).
    # Backends of models with an attention indexer (Qwen4-Exp) also implement:
    #   attend_indexed(layer_idx, q, k, v, scale, index: IndexQuery) -> [T, Hq, D]
    # storing K/V and the raw index keys, each query attending to the tokens its indexer keeps
    # (``models/indexed_attention.py``).
    # Backends of DeepSeek-V4 (compressed sparse attention) also implement:
    #   attend_compressed(layer_idx, q [T, H, D], kv [T, D], branch: CompressedBranch) -> [T, H, D]
    # storing the window rows, the compressed entries and the open windows' pools per sequence
    # (``models/compressed_attention.py`` has the contract and the math).


# NOTE: query rows per block of the explicit (sink) attention: its float32 scores are H x rows x keys
SINK_QUERY_BLOCK = 256


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                   sinks: torch.Tensor) -> torch.Tensor:
    """Softmax attention with one attention-sink logit per head (gpt-oss; Xiao et al. 2023, "Efficient Streaming
    Language Models with Attention Sinks"): ``softmax([q.k * scale, sink])`` with the sink's column dropped before
    the value product. Scores and softmax in float32.

    Args:
        q: ``[..., H, Tq, D]``; k, v: ``[..., H, Tk, D]`` (GQA already expanded).
        mask: bool, broadcastable to ``[..., H, Tq, Tk]`` (True = attend), or None.
        sinks: the logits, broadcastable to ``[..., H, Tq]`` (``[H, 1]``: one per head).

    Returns:
        ``[..., H, Tq, D]`` in ``q``'s dtype; a row that sees no key gets zeros.
    """
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    sink = sinks.float().expand(s.shape[:-1])[..., None]
    top = torch.maximum(s.amax(-1, keepdim=True), sink)
    p = torch.exp(s - top)
    denom = p.sum(-1, keepdim=True) + torch.exp(sink - top)
    return (torch.matmul(p, v.float()) / denom).to(q.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     q_offset: int = 0, *, window: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Reference causal GQA attention for one sequence.

    Args:
        q: ``[Tq, Hq, D]`` queries at absolute positions ``q_offset .. q_offset + Tq - 1``.
        k, v: ``[Tk, Hkv, D]`` keys/values at positions ``0 .. Tk - 1`` (``Tk >= q_offset + Tq``).
        scale: softmax scale.
        q_offset: absolute position of the first query (number of cached tokens before this chunk).
        window, sinks: see :meth:`AttentionBackend.attend`.

    Returns:
        ``[Tq, Hq, D]``. Query i attends to keys ``0 .. q_offset + i`` (inclusive; with ``window``, the last
        ``window`` of them).
    """
    tq, hq, d = q.shape
    k_lo = 0 if window is None else max(0, q_offset - window + 1)  # keys no query of the chunk sees are not read
    k, v = k[k_lo:], v[k_lo:]
    tk, hkv, _ = k.shape
    group = hq // hkv
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    # [1, H, T, D]: with a batch dim, SDPA on a CPU takes its flash kernel (3-D inputs: the math one, ~3x slower)
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if q_offset == 0 and tq == tk and window is None and sinks is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        return out[0].transpose(0, 1)
    qpos = torch.arange(q_offset, q_offset + tq, device=q.device)
    kpos = torch.arange(k_lo, k_lo + tk, device=q.device)
    mask = kpos[None, :] <= qpos[:, None]  # [Tq, Tk] True = attend
    if window is not None:
        mask &= kpos[None, :] > qpos[:, None] - window
    if sinks is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    else:
        out = torch.cat([sink_attention(qh[:, :, i:i + SINK_QUERY_BLOCK], kh, vh, mask[i:i + SINK_QUERY_BLOCK],
                                        scale, sinks[:, None]) for i in range(0, tq, SINK_QUERY_BLOCK)], dim=2)
    return out[0].transpose(0, 1)
