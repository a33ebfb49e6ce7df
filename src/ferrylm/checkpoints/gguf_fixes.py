"""What llama.cpp's ``convert_hf_to_gguf.py`` does to some tensors' values, undone (the tables of
:mod:`ferrylm.checkpoints.gguf_archs` name them per architecture). Each takes a float32 array in PyTorch order and
the served config dict, and returns the HF tensor.
"""

from __future__ import annotations

import numpy as np

from ferrylm.checkpoints.gguf_reader import unpermute_rope_rows


def unpermute_q(w: np.ndarray, cfg: dict) -> np.ndarray:
    """``llama``'s ``attn_q`` rows back from GGML's interleaved RoPE pairs (``LlamaModel.permute``)."""
    return unpermute_rope_rows(w, cfg["num_attention_heads"])


def unpermute_k(w: np.ndarray, cfg: dict) -> np.ndarray:
    """``llama``'s ``attn_k`` rows, as :func:`unpermute_q` with the KV heads."""
    return unpermute_rope_rows(w, cfg["num_key_value_heads"])


def as_row(w: np.ndarray, cfg: dict) -> np.ndarray:
    """A ``[H]`` vector stored for a ``[1, H]`` linear (the shared-expert gate)."""
    return w.reshape(1, -1)


def row_shape(shape: tuple, cfg: dict) -> tuple:
    return (1, shape[-1])


def join_kv_b(parts: list[np.ndarray], cfg: dict) -> np.ndarray:
    """DeepSeek's ``kv_b_proj [H (N + V), R]`` from llama.cpp's ``attn_k_b [H, R, N]`` (stored transposed for the
    absorbed form) and ``attn_v_b [H, V, R]`` (``DeepseekV2Model.modify_tensors``)."""
    k_b, v_b = parts
    return np.ascontiguousarray(np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, k_b.shape[1]))


def kv_b_shape(shapes: list[tuple], cfg: dict) -> tuple:
    (h, r, n), (_, v, _) = shapes
    return (h * (n + v), r)


def minus_one(w: np.ndarray, cfg: dict) -> np.ndarray:
    """Qwen3-Next's zero-centred RMSNorm weights (it scales by ``1 + w``): llama.cpp stores ``1 + w``."""
    return w - np.float32(1)


def a_log(w: np.ndarray, cfg: dict) -> np.ndarray:
    """Gated DeltaNet's ``A_log``: llama.cpp stores ``ssm_a = -exp(A_log)``."""
    return np.log(-w)


def conv_weight(w: np.ndarray, cfg: dict) -> np.ndarray:
    """The depthwise conv ``[C, 1, K]``, stored squeezed ``[C, K]``."""
    return w[:, None, :]


def conv_shape(shape: tuple, cfg: dict) -> tuple:
    return (shape[0], 1, shape[1])


def _linear_dims(cfg: dict) -> tuple[int, int, int, int]:
    """``(key heads, key dim, value heads per key head, value dim)`` of the Gated DeltaNet layers."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    return nk, cfg["linear_key_head_dim"], nv // nk, cfg["linear_value_head_dim"]


def join_qkvz(parts: list[np.ndarray], cfg: dict) -> np.ndarray:
    """Qwen3-Next's ``in_proj_qkvz`` (per key head ``g``: ``q_g, k_g, v_g, z_g``) from llama.cpp's ``attn_qkv``
    (every head's q, then k, then v) and ``attn_gate`` (z), as ``Qwen3NextModel.modify_tensors`` split it."""
    qkv, z = parts
    nk, dk, r, dv = _linear_dims(cfg)
    h = qkv.shape[-1]
    q, k, v = (qkv[:nk * dk].reshape(nk, dk, h), qkv[nk * dk:2 * nk * dk].reshape(nk, dk, h),
               qkv[2 * nk * dk:].reshape(nk, r * dv, h))
    return np.ascontiguousarray(np.concatenate([q, k, v, z.reshape(nk, r * dv, h)], axis=1).reshape(-1, h))


def qkvz_shape(shapes: list[tuple], cfg: dict) -> tuple:
    (rows, h), (z_rows, _) = shapes
    return (rows + z_rows, h)


def _grouped(w: np.ndarray, axis: int, cfg: dict, d: int) -> np.ndarray:
    """Value heads back from llama.cpp's tiled order ``[r, nk, d]`` to grouped by key head ``[nk, r, d]`` along
    ``axis`` (``_LinearAttentionVReorderBase._reorder_v_heads``, inverted; the identity when ``r == 1``)."""
    nk, _, r, _ = _linear_dims(cfg)
    shape = w.shape
    x = w.reshape(*shape[:axis], r, nk, d, *shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(x, axis, axis + 1).reshape(shape))


def qkv_rows(w: np.ndarray, cfg: dict) -> np.ndarray:
    """Qwen3.5's ``in_proj_qkv``: the value rows (after every q and k row) regrouped."""
    nk, dk, _, dv = _linear_dims(cfg)
    return np.concatenate([w[:2 * nk * dk], _grouped(w[2 * nk * dk:], 0, cfg, dv)])


def value_rows(w: np.ndarray, cfg: dict) -> np.ndarray:
    """Qwen3.5's ``in_proj_z``: rows regrouped."""
    return _grouped(w, 0, cfg, cfg["linear_value_head_dim"])


def head_rows(w: np.ndarray, cfg: dict) -> np.ndarray:
    """One row (or value) per value head regrouped: ``in_proj_a`` / ``in_proj_b``, ``dt_bias``."""
    return _grouped(w, 0, cfg, 1)


def a_log_heads(w: np.ndarray, cfg: dict) -> np.ndarray:
    """Qwen3.5's ``A_log``: :func:`a_log` of the regrouped heads."""
    return a_log(head_rows(w, cfg), cfg)


def value_columns(w: np.ndarray, cfg: dict) -> np.ndarray:
    """Qwen3.5's ``out_proj``: input columns regrouped."""
    return _grouped(w, 1, cfg, cfg["linear_value_head_dim"])


def conv_heads(w: np.ndarray, cfg: dict) -> np.ndarray:
    """Qwen3.5's conv: the value channels regrouped, then :func:`conv_weight`."""
    return conv_weight(qkv_rows(w, cfg), cfg)
