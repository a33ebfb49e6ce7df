"""The contract between model code and the KV cache.

Model code never owns KV memory. Each forward pass receives an :class:`AttentionBackend` that, for one layer,
stores the new keys/values and returns the attention output for the batch's query tokens. The engine passes a
paged implementations (``engine/attention/``); tests and reference runs use :class:`DenseCausalAttention`
(one sequence, no cache).

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
               scale: float) -> torch.Tensor:
        """Causal attention of the step's query tokens over their sequences' cached + new K/V.

        Args:
            layer_idx: decoder layer index (0-based).
            q: ``[T, num_heads, head_dim]`` queries, RoPE applied.
            k: ``[T, num_kv_heads, head_dim]`` new keys, RoPE applied (stored by the call).
            v: ``[T, num_kv_heads, head_dim]`` new values (stored by the call).
            scale: softmax scale (usually ``head_dim ** -0.5``).

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


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     q_offset: int = 0) -> torch.Tensor:
    """Reference causal GQA attention for one sequence.

    Args:
        q: ``[Tq, Hq, D]`` queries at absolute positions ``q_offset .. q_offset + Tq - 1``.
        k, v: ``[Tk, Hkv, D]`` keys/values at positions ``0 .. Tk - 1`` (``Tk >= q_offset + Tq``).
        scale: softmax scale.
        q_offset: absolute position of the first query (number of cached tokens before this chunk).

    Returns:
        ``[Tq, Hq, D]``. Query i attends to keys ``0 .. q_offset + i`` (inclusive).
    """
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    group = hq // hkv
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, T, D]
    if q_offset == 0 and tq == tk:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        qpos = torch.arange(q_offset, q_offset + tq, device=q.device)
        kpos = torch.arange(tk, device=q.device)
        mask = kpos[None, :] <= qpos[:, None]  # [Tq, Tk] True = attend
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


class DenseCausalAttention:
    """One sequence, whole prompt in one forward, no cache. For parity tests against transformers."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        return causal_attention(q, k, v, scale)

    def attend_latent(self, layer_idx: int, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                      k_pe: torch.Tensor, proj, scale: float) -> torch.Tensor:
        """MLA over the call's own tokens (``models/latent_attention.py``): ``[T, H, V]``."""
        from ferrylm.models.latent_attention import latent_chunk_attention, latent_row

        return latent_chunk_attention(q_nope, q_pe, latent_row(c_kv, k_pe)[:, 0], proj, scale, q_offset=0)


class SequenceCacheAttention:
    """One sequence with a growing K/V cache (per layer, concatenated), no pages. The reference for chunked
    prefill + decode in tests: feed a prompt in chunks, then one token per call, positions continuing.

    Memory: grows by ``2 * T * Hkv * D`` elements per layer per call (``T`` new tokens); each call re-concatenates
    the cache, so it is O(length^2) over a sequence — a reference, not a serving path.
    """

    def __init__(self):
        self.k: dict[int, list[torch.Tensor]] = {}
        self.v: dict[int, list[torch.Tensor]] = {}

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """See :class:`AttentionBackend`; the new ``k``/``v`` ``[T, Hkv, D]`` follow everything cached."""
        ks, vs = self.k.setdefault(layer_idx, []), self.v.setdefault(layer_idx, [])
        offset = sum(t.shape[0] for t in ks)
        ks.append(k)
        vs.append(v)
        return causal_attention(q, torch.cat(ks), torch.cat(vs), scale, q_offset=offset)

    def attend_latent(self, layer_idx: int, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                      k_pe: torch.Tensor, proj, scale: float) -> torch.Tensor:
        """MLA (``models/latent_attention.py``); the new latent rows ``[c_kv ; k_pe]`` follow everything cached
        (kept in ``k``; ``v`` stays empty for the layer)."""
        from ferrylm.models.latent_attention import latent_chunk_attention, latent_row

        rows = self.k.setdefault(layer_idx, [])
        offset = sum(t.shape[0] for t in rows)
        rows.append(latent_row(c_kv, k_pe)[:, 0])
        return latent_chunk_attention(q_nope, q_pe, torch.cat(rows), proj, scale, q_offset=offset)
