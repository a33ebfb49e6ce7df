"""Tiny MoE GGUF files written with gguf-py's ``GGUFWriter`` from tiny transformers checkpoints.

Block packers: ``Q8_0`` and ``MXFP4`` come from gguf-py's own ``quants.quantize``; gguf-py has no quantizer for
the k-quants, so :func:`pack_q4_k` and :func:`pack_q6_k` are ours (min/max per sub-block, not llama.cpp's
search), laid out as ggml's ``block_q4_K`` / ``block_q6_K`` and checked in the tests against gguf-py's
``dequantize`` (the reference dequantizer). Q/K rows of the ``llama`` architecture are permuted as llama.cpp's
``convert_hf_to_gguf.py`` does (``LlamaModel.permute``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter
from gguf.quants import quantize

TYPES = {"Q8_0": QT.Q8_0, "Q4_K": QT.Q4_K, "Q6_K": QT.Q6_K, "F32": QT.F32, "MXFP4": QT.MXFP4}


def pack_q4_k(w: np.ndarray) -> np.ndarray:
    """``w [R, K]`` float32 (``K % 256 == 0``) -> ``[R, K / 256 * 144]`` uint8 ``block_q4_K`` bytes:
    ``d``, ``dmin`` float16, 12 bytes of 6-bit scales/mins (sub-blocks 0-3 in the low 6 bits of bytes 0-3 / 4-7,
    4-7 split: low 4 bits in bytes 8-11, high 2 bits in the top of bytes 0-7), 128 bytes of nibbles (chunk ``c``:
    elements ``64c .. 64c+31`` low, ``64c+32 .. 64c+63`` high)."""
    r, k = w.shape
    x = w.reshape(-1, 8, 32).astype(np.float32)  # [blocks, sub, 32]
    lo, hi = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
    scale, mn = (hi - lo) / 15, -lo
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (mn.max(-1) / 63).astype(np.float16)
    df, dminf = np.maximum(d.astype(np.float32), 1e-12), np.maximum(dmin.astype(np.float32), 1e-12)
    sc = np.clip(np.round(scale / df[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.round(mn / dminf[:, None]), 0, 63).astype(np.uint8)
    eff_s = d.astype(np.float32)[:, None] * sc
    eff_m = dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.round((x + eff_m[..., None]) / eff_s[..., None]), 0, 15).astype(np.uint8)  # [b, 8, 32]
    scales = np.zeros((x.shape[0], 12), np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), scales, qs], 1)
    return out.reshape(r, -1)


def pack_q6_k(w: np.ndarray) -> np.ndarray:
    """``w [R, K]`` (``K % 256 == 0``) -> ``[R, K / 256 * 210]`` ``block_q6_K`` bytes: ``ql[128]`` (element
    ``128h + 64s + t`` in nibble ``s`` of ``ql[64h + t]``), ``qh[64]`` (element ``128h + 32s + l``'s two high bits
    at ``2s`` of ``qh[32h + l]``), ``scales[16]`` int8, ``d`` float16; value ``d * scale * (q - 32)``."""
    r, k = w.shape
    x = w.reshape(-1, 16, 16).astype(np.float32)
    amax = np.abs(x).max(-1)
    sub = amax / 31
    d = (np.maximum(sub.max(-1), 1e-12) / 127).astype(np.float16)
    sc = np.clip(np.round(sub / np.maximum(d.astype(np.float32), 1e-12)[:, None]), 1, 127).astype(np.int8)
    eff = d.astype(np.float32)[:, None] * sc
    q = (np.clip(np.round(x / eff[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    v = q.reshape(-1, 2, 2, 64)  # (h, s, t)
    ql = (v[:, :, 0] & 15) | ((v[:, :, 1] & 15) << 4)  # [b, 2, 64]
    u = q.reshape(-1, 2, 4, 32)  # (h, s, l)
    qh = (u[:, :, 0] >> 4) | ((u[:, :, 1] >> 4) << 2) | ((u[:, :, 2] >> 4) << 4) | ((u[:, :, 3] >> 4) << 6)
    out = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d[:, None].view(np.uint8)], 1)
    return out.reshape(r, -1)


def encode(w: torch.Tensor, qtype: str) -> np.ndarray:
    """``w [..., N, K]`` in GGUF's ``qtype`` as the byte array ``GGUFWriter.add_tensor`` takes (``[..., N, bytes]``)."""
    a = w.float().numpy()
    if qtype == "F32":
        return a
    rows = a.reshape(-1, a.shape[-1])
    raw = pack_q4_k(rows) if qtype == "Q4_K" else pack_q6_k(rows) if qtype == "Q6_K" else quantize(rows, TYPES[qtype])
    return raw.reshape(*a.shape[:-1], -1)


def permute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute``: HF rotate-halves rows -> GGML interleaved pairs, per head."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_vocab() -> tuple[list[str], list[str], list[int]]:
    """A tiny byte-level BPE vocabulary: the 256 GPT-2 byte symbols, two merges, two control tokens."""
    from tokenizers.pre_tokenizers import ByteLevel

    byte_tokens = sorted(ByteLevel.alphabet())
    merges = ["Ġ t", "h e"]
    tokens = byte_tokens + ["Ġt", "he", "<|im_start|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    return tokens, merges, types


CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def write_moe_gguf(path: Path, arch: str, hf_cfg: dict, tensors: dict[str, torch.Tensor],
                   types: dict[str, str]) -> Path:
    """Write ``tensors`` (GGUF name -> PyTorch-order tensor) with GGUF types ``types`` (default F32) and the
    metadata of ``arch`` from the HF config dict ``hf_cfg``."""
    w = GGUFWriter(str(path), arch)
    hidden, heads = hf_cfg["hidden_size"], hf_cfg["num_attention_heads"]
    head_dim = hf_cfg.get("head_dim") or hidden // heads
    w.add_block_count(hf_cfg["num_hidden_layers"])
    w.add_context_length(hf_cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(hf_cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(hf_cfg["rms_norm_eps"])
    w.add_rope_freq_base(hf_cfg.get("rope_theta") or hf_cfg["rope_parameters"]["rope_theta"])
    w.add_expert_count(hf_cfg.get("num_local_experts") or hf_cfg["num_experts"])
    w.add_expert_used_count(hf_cfg["num_experts_per_tok"])
    w.add_feed_forward_length(hf_cfg["intermediate_size"])
    if "moe_intermediate_size" in hf_cfg:
        w.add_expert_feed_forward_length(hf_cfg["moe_intermediate_size"])
    if hf_cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(hf_cfg["shared_expert_intermediate_size"])
    tokens, merges, ttypes = byte_vocab()
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(ttypes)
    w.add_token_merges(merges)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_bos_token_id(len(tokens) - 2)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, t in tensors.items():
        qtype = types.get(name, "F32")
        data = encode(t, qtype)
        w.add_tensor(name, data, raw_dtype=None if qtype == "F32" else TYPES[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
