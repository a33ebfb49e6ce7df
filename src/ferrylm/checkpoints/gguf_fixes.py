"""What llama.cpp's ``convert_hf_to_gguf.py`` does to some tensors' values, undone (the tables of
:mod:`ferrylm.checkpoints.gguf_archs` name them per architecture). Each takes a float32 array in PyTorch order and
the served config dict, and returns the HF tensor.
"""

from __future__ import annotations

import numpy as np

from ferrylm.checkpoints.gguf_convert import unpermute_rope_rows


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
