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
