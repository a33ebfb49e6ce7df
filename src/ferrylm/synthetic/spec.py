"""Synthetic models: real architecture shapes, random weights made in memory, optional Zipf-skewed routing.

``--model synthetic:<preset>[:layers=N][:skew=A][:routing=R][:seed=S][:quant=Q][:tokenizer=FOLDER]``

- ``preset``: a published model's shape (:data:`PRESETS`; ``ferry models`` lists them).
- ``layers=N``: keep the first ``N`` decoder layers (``1 <= N <=`` the preset's); every layer keeps its shape, so
  per-layer cost is the real model's.
- ``skew=A``: Zipf exponent ``A >= 0`` of expert popularity (0, the default, = uniform); see
  :mod:`ferrylm.synthetic.build` for the method.
- ``routing=R``: who chooses each token's experts (:data:`~ferrylm.synthetic.routing_profiles.ROUTING_CHOICES`):
  ``router`` (the random router's own top-k, shaped by ``skew``) or a routing-model profile (``qwen3``, ``olmoe``,
  ``wide512`` calibrated to published locality figures, ``uniform`` the worst case; see
  :mod:`ferrylm.synthetic.routing_model` and docs/ROUTING.md). Default: the preset family's calibrated profile
  (Qwen-MoE presets ``qwen3``, OLMoE ``olmoe``), or ``router`` when ``skew`` is given or the family has none.
- ``seed=S``: weight seed (default 0). Same spec → same weights → same logits, run after run.
- ``quant=Q``: routed experts quantized (:data:`SYNTHETIC_QUANT`: ``fp8``, ``int4``, ``mxfp4``, ``nvfp4``, GGML
  blocks ``q4_k``, ``q4_k_m``, ``q8_0``): random
  codes and scales made directly in the stored format (nothing is quantized from bf16), so banks, slots and copies
  carry the bytes a real checkpoint of that format has.
- ``tokenizer=FOLDER``: a tokenizer folder for serving text (``ferry --tokenizer FOLDER`` appends it); it must be
  the last option (it takes the rest of the spec, so the path may contain ``:``). Without it the model is token
  ids in, token ids out.

No checkpoint is written. :func:`materialize` writes a small folder into the model cache holding the
``config.json`` (an HF config of the preset plus a ``ferrylm_synthetic`` recipe key) and links to the tokenizer
files, so that every part that passes a model *folder* around (the engine process, the server's config and
tokenizer reading) works unchanged; the engine builds the weights from the recipe
(:func:`ferrylm.synthetic.build.build_synthetic`, called by ``load_model``).

This module does not import torch (the CLI and the HTTP frontend use it).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ferrylm.errors import ModelLoadError
from ferrylm.synthetic.routing_profiles import ROUTER, ROUTING_CHOICES, default_routing

SYNTHETIC_PREFIX = "synthetic:"
RECIPE_KEY = "ferrylm_synthetic"  # config.json key holding the recipe; its presence marks a synthetic folder
RECIPE_FORMAT = 1
# NOTE: a ferrylm-only config.json key (never in HF checkpoints): when true, every router has a bias ``gate.bias
# [E]`` added to its logits (models/moe.py). Synthetic models with skew > 0 set it.
ROUTER_BIAS_KEY = "ferrylm_router_bias"
# NOTE: a ferrylm-only config.json key: ``{"profile": name, "seed": S}`` when a routing model chooses the experts
# (synthetic ``routing=`` other than ``router``; models/moe.py, synthetic/routing_model.py).
ROUTING_KEY = "ferrylm_routing"
#: ``quant=`` names -> what the routed experts become (:mod:`ferrylm.synthetic.build` has the formats)
SYNTHETIC_QUANT = {
    "fp8": "fp8 e4m3, float32 scale per 128 inputs (as DeepSeek-V3 / Qwen3-FP8 128x128 blocks)",
    "int4": "int4 symmetric, bfloat16 scale per 128 inputs (as compressed-tensors W4A16)",
    "mxfp4": "fp4 e2m1, power-of-two scale per 32 inputs (OCP MXFP4, as gpt-oss)",
    "nvfp4": "fp4 e2m1, fp8 e4m3 scale per 16 inputs and a float32 scale per row (NVFP4)",
    "q4_k": "GGML Q4_K blocks, 4.5 bits/weight (as a GGUF's experts, kept as bytes)",
    "q4_k_m": "GGML Q4_K gate/up, Q6_K down blocks (llama.cpp Q4_K_M's heavier layers)",
    "q8_0": "GGML Q8_0 blocks, 8.5 bits/weight",
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                    "special_tokens_map.json", "added_tokens.json")


def _gpt_oss(layers: int, experts: int) -> dict[str, Any]:
    """gpt-oss-20b / -120b's config.json (openai/gpt-oss-*): they differ in layers and experts only."""
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
            "eos_token_id": 200002, "pad_token_id": 199999, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
            "intermediate_size": 2880, "max_position_embeddings": 131072, "num_attention_heads": 64,
            "num_experts_per_tok": 4, "num_hidden_layers": layers, "num_key_value_heads": 8,
            "num_local_experts": experts, "rms_norm_eps": 1e-5, "sliding_window": 128, "swiglu_limit": 7.0,
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 4096},
            "rope_theta": 150000.0, "tie_word_embeddings": False, "vocab_size": 201088}


@dataclass(frozen=True)
class SyntheticPreset:
    """A published model's shape.

    Attributes:
        name: the ``synthetic:<name>`` preset name.
        source: the Hugging Face repository whose ``config.json`` the values were taken from.
        config: that config.json's fields (the ones ferrylm reads; ``architectures`` included).
    """

    name: str
    source: str
    config: dict[str, Any] = field(repr=False)

    def summary(self) -> str:
        """One line: layers, width, experts, heads, vocab, and the bf16 bytes of one layer's routed experts."""
        c = self.config
        heads = f"{c['num_attention_heads']} q / {c.get('num_key_value_heads', c['num_attention_heads'])} kv heads"
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        experts = c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 0
        width = c.get("moe_intermediate_size") or c["intermediate_size"]
        layer_gib = experts * 3 * c["hidden_size"] * width * 2 / 2**30
        shared = c.get("shared_expert_intermediate_size") or (c.get("n_shared_experts") or 0) * width
        extra = f", shared expert {shared}" if shared else ""
        if c.get("kv_lora_rank"):  # multi-head latent attention: what a head computes and what a token caches
            head_dim = (f"{c['qk_nope_head_dim']}+{c['qk_rope_head_dim']} (MLA, latent {c['kv_lora_rank']}+"
                        f"{c['qk_rope_head_dim']} cached per token)")
        return (f"{c['architectures'][0]}: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
                f"{experts} experts top-{c['num_experts_per_tok']} width {width}{extra}, {heads} x {head_dim}, "
                f"vocab {c['vocab_size']}; routed experts {layer_gib:.2f} GiB/layer in bf16 (from {self.source})")


def _qwen3_moe(**shape: Any) -> dict[str, Any]:
    base = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1, "head_dim": 128,
        "hidden_act": "silu", "max_position_embeddings": 40960, "mlp_only_layers": [], "norm_topk_prob": True,
        "num_experts": 128, "num_experts_per_tok": 8, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
        "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None, "use_sliding_window": False,
        "tie_word_embeddings": False, "vocab_size": 151936,
    }
    return {**base, **shape}


def _deepseek_v3(**shape: Any) -> dict[str, Any]:
    """The fields DeepSeek-V3 and Kimi-K2 share (their config.json), updated by ``shape``."""
    base = {
        "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "hidden_act": "silu",
        "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512, "moe_intermediate_size": 2048,
        "moe_layer_freq": 1, "n_shared_experts": 1, "norm_topk_prob": True, "num_experts_per_tok": 8,
        "num_hidden_layers": 61, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_method": "noaux_tc", "v_head_dim": 128,
    }
    return {**base, **shape}


def _minimax_m2() -> dict[str, Any]:
    """MiniMax-M2's config.json fields (MiniMaxAI/MiniMax-M2); M2.5 publishes the same architecture and shapes."""
    return {
        "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "eos_token_id": 200020, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 1536, "max_position_embeddings": 196608,
        "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": 62, "num_key_value_heads": 8,
        "num_local_experts": 256, "qk_norm_type": "per_layer", "rms_norm_eps": 1e-6, "rope_theta": 5000000.0,
        "rotary_dim": 64, "scoring_func": "sigmoid", "shared_intermediate_size": 0, "tie_word_embeddings": False,
        "use_qk_norm": True, "use_routing_bias": True, "vocab_size": 200064}


# NOTE: values are those of each source repository's config.json (fields ferrylm reads), as published.
PRESETS: dict[str, SyntheticPreset] = {p.name: p for p in (
    SyntheticPreset("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", _qwen3_moe(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, max_window_layers=48)),
    SyntheticPreset("qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B", _qwen3_moe(
        hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=94,
        num_attention_heads=64, max_window_layers=94)),
    SyntheticPreset("olmoe-1b-7b", "allenai/OLMoE-1B-7B-0924", {
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "attention_bias": False, "clip_qkv": None,
        "bos_token_id": None, "eos_token_id": 50279, "pad_token_id": 1, "hidden_act": "silu", "hidden_size": 2048,
        "intermediate_size": 1024, "max_position_embeddings": 4096, "norm_topk_prob": False,
        "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
        "num_hidden_layers": 16, "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "vocab_size": 50304}),
    SyntheticPreset("mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1", {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "num_hidden_layers": 32, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None,
        "tie_word_embeddings": False, "vocab_size": 32000}),
    # 106B total / 12B active; the published checkpoint's extra MTP layer (num_nextn_predict_layers) is not built
    SyntheticPreset("glm-4.5-air", "zai-org/GLM-4.5-Air", {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
        "eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329, "first_k_dense_replace": 1,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 10944,
        "max_position_embeddings": 131072, "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 128,
        "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 96, "num_experts_per_tok": 8,
        "num_hidden_layers": 46, "num_key_value_heads": 8, "num_nextn_predict_layers": 1,
        "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 1000000.0,
        "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "topk_group": 1, "use_qk_norm": False,
        "vocab_size": 151552}),
    # gpt-oss: attention sinks, sliding-window (128) / full layers alternating, biased experts with a clamped SwiGLU
    SyntheticPreset("gpt-oss-20b", "openai/gpt-oss-20b", _gpt_oss(24, 32)),
    SyntheticPreset("gpt-oss-120b", "openai/gpt-oss-120b", _gpt_oss(36, 128)),
    # 230B total / 10B active; MTP modules (use_mtp, num_mtp_modules) are not built
    SyntheticPreset("minimax-m2", "MiniMaxAI/MiniMax-M2", _minimax_m2()),
    # M2.5 keeps M2's architecture and shapes (230B / 10B active); NVIDIA's ModelOpt NVFP4 export of it
    # (nvidia/MiniMax-M2.5-NVFP4: routed experts in NVFP4, attention and router in bf16) is ``quant=nvfp4``
    SyntheticPreset("minimax-m2.5", "MiniMaxAI/MiniMax-M2.5", _minimax_m2()),
    # 80B total / 3B active; hybrid: every 4th layer gated full attention, the others Gated DeltaNet; MTP not built
    SyntheticPreset("qwen3-next-80b-a3b", "Qwen/Qwen3-Next-80B-A3B-Instruct", {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "attention_bias": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1, "full_attention_interval": 4,
        "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 5120,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
        "mlp_only_layers": [], "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16,
        "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2,
        "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 10000000,
        "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "vocab_size": 151936}),
    # 35B total / 3B active; the text model of the multimodal checkpoint (its text_config, flattened);
    # 3 Gated DeltaNet layers per gated attention layer; vision tower and MTP not built
    SyntheticPreset("qwen3.5-35b-a3b", "Qwen/Qwen3.5-35B-A3B", {
        "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "attention_bias": False,
        "attn_output_gate": True, "bos_token_id": 248044, "eos_token_id": 248044, "full_attention_interval": 4,
        "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 10,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
        "moe_intermediate_size": 512, "num_attention_heads": 16, "num_experts": 256, "num_experts_per_tok": 8,
        "num_hidden_layers": 40, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                            "rope_theta": 10000000, "rope_type": "default"},
        "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "vocab_size": 248320}),
    # Qwen3.8-Flash-Next (qwen4_exp): 176B total (125B + one 51B hashed n-gram PLE table) / ~6B active; 3 Gated
    # DeltaNet layers per indexed attention layer, 4 hyper-connection streams; vision tower and MTP not built. The
    # PLE layer's position (ple_layer_ids) is not in the published metadata we read: layer 1 here (sizes do not
    # depend on it). A synthetic build reads PLE rows from its seeded value pool (no 95 GiB table in memory).
    SyntheticPreset("qwen3.8-flash-next", "Qwen/Qwen3.8-Flash-Next", {
        "architectures": ["Qwen4ExpForCausalLM"], "model_type": "qwen4_exp_text", "attention_bias": False,
        "bos_token_id": 248044, "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256,
        "hidden_act": "silu", "hidden_size": 2560, "hc_count": 4, "hc_lowrank": 320,
        "indexer_budget": 2048, "indexer_compress_ratio": 4, "indexer_head_dim": 128, "indexer_kv_heads": 1,
        "indexer_n_heads": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 12,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 48, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
        "moe_intermediate_size": 640, "num_attention_heads": 24, "num_experts": 512, "num_experts_per_tok": 10,
        "num_hidden_layers": 48, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "ple_layer_ids": [1], "ple_embed_dim": 2560, "ple_conv_kernel_size": 4, "ngram_size": 3,
        "heads_per_ngram": 8, "ngram_vocab_size_base": 20_000_000, "make_ngram_vocab_size_divisible_by": 128,
        "split_ngram_parts": 512, "seed": 1234,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                            "rope_theta": 10000000, "rope_type": "default"},
        "shared_expert_intermediate_size": 640, "tie_word_embeddings": False, "vocab_size": 248320}),
    # 671B total / 37B active; FP8 128x128 blocks as published; the MTP layer (num_nextn_predict_layers) not built
    SyntheticPreset("deepseek-v3", "deepseek-ai/DeepSeek-V3", _deepseek_v3(
        model_type="deepseek_v3", bos_token_id=0, eos_token_id=1, first_k_dense_replace=3, max_position_embeddings=163840,
        n_group=8, n_routed_experts=256, num_attention_heads=128, num_key_value_heads=128, rms_norm_eps=1e-6,
        rope_theta=10000.0, routed_scaling_factor=2.5, topk_group=4, vocab_size=129280, num_nextn_predict_layers=1,
        rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 4096, "type": "yarn"})),
    # 1T total / 32B active: DeepSeek-V3's architecture with 384 experts, 64 heads, one dense layer, no groups
    SyntheticPreset("kimi-k2", "moonshotai/Kimi-K2-Instruct-0905", _deepseek_v3(
        model_type="kimi_k2", bos_token_id=163584, eos_token_id=163585, first_k_dense_replace=1,
        max_position_embeddings=262144, n_group=1, n_routed_experts=384, num_attention_heads=64,
        num_key_value_heads=64, rms_norm_eps=1e-5, rope_theta=50000.0, routed_scaling_factor=2.827, topk_group=1,
        vocab_size=163840, num_nextn_predict_layers=0,
        rope_scaling={"beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 4096, "type": "yarn"})),
    # 284B total / 13B active; the shape of transformers' DeepseekV4Config (its documented checkpoint) and the
    # layer schedule it defaults to (two HCA layers, then CSA / HCA alternating); the MTP layer not built
    SyntheticPreset("deepseek-v4-flash", "deepseek-ai/DeepSeek-V4-Flash", {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "bos_token_id": 0,
        "eos_token_id": 1, "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048,
        "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
        "q_lora_rank": 1024, "partial_rotary_factor": 0.125, "n_routed_experts": 256, "num_experts_per_tok": 6,
        "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
        "max_position_embeddings": 1048576, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "layer_types": ["heavily_compressed_attention"] * 2 + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(41)],
        "mlp_layer_types": ["hash_moe"] * 3 + ["moe"] * 40, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "swiglu_limit": 10.0, "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64,
        "index_head_dim": 128, "index_topk": 512, "num_nextn_predict_layers": 1, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False}),
    SyntheticPreset("qwen2-57b-a14b", "Qwen/Qwen2-57B-A14B", {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "bos_token_id": 151643,
        "eos_token_id": 151643, "decoder_sparse_step": 1, "hidden_act": "silu", "hidden_size": 3584,
        "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
        "moe_intermediate_size": 2560, "shared_expert_intermediate_size": 20480, "norm_topk_prob": False,
        "num_attention_heads": 28, "num_key_value_heads": 4, "num_experts": 64, "num_experts_per_tok": 8,
        "num_hidden_layers": 28, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": 131072,
        "use_sliding_window": False, "tie_word_embeddings": False, "vocab_size": 151936}),
)}


@dataclass(frozen=True)
class SyntheticSpec:
    """A parsed ``synthetic:`` spec.

    Attributes:
        preset: the shape (a :class:`SyntheticPreset`; tests may pass their own).
        layers: decoder layers kept (``1 ..`` the preset's).
        skew: Zipf exponent of expert popularity (0 = uniform).
        seed: weight seed.
        tokenizer: absolute path of a tokenizer folder, or None.
        quant: a :data:`SYNTHETIC_QUANT` name for the routed experts, or None (plain weights).
        routing: ``router`` or a routing profile name (see the module docstring); a spec built directly (not
            parsed) keeps the router's own routing unless it says otherwise.
    """

    preset: SyntheticPreset
    layers: int
    skew: float = 0.0
    seed: int = 0
    tokenizer: str | None = None
    quant: str | None = None
    routing: str = ROUTER

    @property
    def name(self) -> str:
        """The canonical spec without the tokenizer (the served model name): defaults left out, e.g.
        ``synthetic:qwen3-30b-a3b:layers=2``."""
        parts = [SYNTHETIC_PREFIX + self.preset.name]
        if self.layers != self.preset.config["num_hidden_layers"]:
            parts.append(f"layers={self.layers}")
        if self.skew:
            parts.append(f"skew={self.skew:g}")
        if self.routing != default_routing(self.preset.config.get("model_type", ""), self.skew):
            parts.append(f"routing={self.routing}")
        if self.seed:
            parts.append(f"seed={self.seed}")
        if self.quant:
            parts.append(f"quant={self.quant}")
        return ":".join(parts)

    def config(self) -> dict[str, Any]:
        """The HF-style config.json dict of the synthetic model (see :func:`synthetic_config`)."""
        return synthetic_config(self)


def is_synthetic_spec(spec: str) -> bool:
    return spec.startswith(SYNTHETIC_PREFIX)


def parse_synthetic_spec(spec: str) -> SyntheticSpec:
    """Parse ``synthetic:<preset>[:layers=N][:skew=A][:routing=R][:seed=S][:quant=Q][:tokenizer=FOLDER]`` (options
    in any order, each at most once, ``tokenizer`` last).

    Raises:
        ModelLoadError: not a synthetic spec, unknown preset (the message lists the presets), unknown or repeated
            option, a value out of range (``layers`` in ``1 .. preset layers``, ``skew >= 0`` and finite,
            ``seed >= 0``, ``quant`` one of :data:`SYNTHETIC_QUANT`, ``routing`` one of ``ROUTING_CHOICES``), a
            tokenizer folder that does not exist.
    """
    if not is_synthetic_spec(spec):
        raise ModelLoadError(f"{spec!r} is not a synthetic model spec (it starts with {SYNTHETIC_PREFIX!r})")
    body = spec[len(SYNTHETIC_PREFIX):]
    tokenizer = None
    if ":tokenizer=" in f":{body}":
        body, _, tokenizer = f":{body}".partition(":tokenizer=")
        body = body[1:]
    name, *options = body.split(":") if body else [""]
    preset = PRESETS.get(name)
    if preset is None:
        raise ModelLoadError(f"unknown synthetic preset {name!r}; presets: {', '.join(PRESETS)} "
                             f"(spec: synthetic:<preset>[:layers=N][:skew=A][:routing=R][:seed=S][:quant=Q])")
    values: dict[str, str] = {}
    for opt in options:
        key, eq, value = opt.partition("=")
        if key not in ("layers", "skew", "seed", "quant", "routing") or not eq:
            raise ModelLoadError(f"{spec}: unknown option {opt!r}; options: layers=N, skew=A, "
                                 f"routing={'|'.join(ROUTING_CHOICES)}, seed=S, "
                                 f"quant={'|'.join(SYNTHETIC_QUANT)}, tokenizer=FOLDER")
        if key in values:
            raise ModelLoadError(f"{spec}: option {key!r} given twice")
        values[key] = value
    max_layers = int(preset.config["num_hidden_layers"])
    try:
        layers = int(values.get("layers", max_layers))
        skew = float(values.get("skew", 0.0))
        seed = int(values.get("seed", 0))
    except ValueError as e:
        raise ModelLoadError(f"{spec}: bad option value ({e})") from None
    if not 1 <= layers <= max_layers:
        raise ModelLoadError(f"{spec}: layers must be in 1..{max_layers} for {name}, got {layers}")
    if not (skew >= 0 and skew < float("inf")):
        raise ModelLoadError(f"{spec}: skew must be a finite number >= 0, got {values.get('skew')}")
    if seed < 0:
        raise ModelLoadError(f"{spec}: seed must be >= 0, got {seed}")
    quant = values.get("quant")
    if quant is not None and quant not in SYNTHETIC_QUANT:
        raise ModelLoadError(f"{spec}: unknown quant {quant!r}; quant formats: {', '.join(SYNTHETIC_QUANT)}")
    if tokenizer is not None:
        tok = Path(tokenizer).expanduser()
        if not tok.is_dir():
            raise ModelLoadError(f"{spec}: tokenizer folder {tokenizer!r} does not exist")
        tokenizer = str(tok.resolve())
    routing = values.get("routing", default_routing(preset.config.get("model_type", ""), skew))
    if routing not in ROUTING_CHOICES:
        raise ModelLoadError(f"{spec}: unknown routing {routing!r}; routing: {', '.join(ROUTING_CHOICES)}")
    return SyntheticSpec(preset, layers, skew, seed, tokenizer, quant, routing)


def with_tokenizer(spec: str, tokenizer: str | None) -> str:
    """``spec`` with ``:tokenizer=<abs path>`` appended (how ``--tokenizer`` reaches every reader of ``--model``).

    Raises:
        ModelLoadError: ``spec`` is not synthetic (model folders carry their own tokenizer) or already names one.
    """
    if tokenizer is None:
        return spec
    if not is_synthetic_spec(spec):
        raise ModelLoadError("--tokenizer applies to synthetic: models only (a model folder carries its own "
                             "tokenizer)")
    if ":tokenizer=" in spec:
        raise ModelLoadError(f"{spec} already names a tokenizer; drop --tokenizer or the spec's tokenizer=")
    return f"{spec}:tokenizer={Path(tokenizer).expanduser().resolve()}"


def synthetic_config(spec: SyntheticSpec) -> dict[str, Any]:
    """The config.json dict: the preset's, with ``num_hidden_layers = spec.layers`` (``mlp_only_layers`` and
    ``layer_types`` cut to them), ``torch_dtype`` bfloat16, the router-bias switch when ``skew > 0``, the routing-model key
    (``ROUTING_KEY``) when ``routing`` is a profile, and the recipe under ``RECIPE_KEY``."""
    cfg = copy.deepcopy(spec.preset.config)
    cfg["num_hidden_layers"] = spec.layers
    if cfg.get("mlp_only_layers"):
        cfg["mlp_only_layers"] = [i for i in cfg["mlp_only_layers"] if i < spec.layers]
    if "max_window_layers" in cfg:
        cfg["max_window_layers"] = min(int(cfg["max_window_layers"]), spec.layers)
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = cfg["layer_types"][:spec.layers]
    cfg["torch_dtype"] = "bfloat16"
    if spec.skew > 0:
        cfg[ROUTER_BIAS_KEY] = True
    cfg[RECIPE_KEY] = {"format": RECIPE_FORMAT, "preset": spec.preset.name, "source": spec.preset.source,
                       "layers": spec.layers, "skew": spec.skew, "seed": spec.seed,
                       "preset_config": spec.preset.config}
    if spec.quant:
        cfg[RECIPE_KEY]["quant"] = spec.quant
    if spec.routing != ROUTER:
        cfg[RECIPE_KEY]["routing"] = spec.routing
        cfg[ROUTING_KEY] = {"profile": spec.routing, "seed": spec.seed}
    return cfg


def read_config(model_dir: str | os.PathLike) -> dict[str, Any] | None:
    """``model_dir/config.json`` as a dict, or None when missing or unreadable."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def is_synthetic_folder(model_dir: str | os.PathLike) -> bool:
    """True when ``model_dir`` is a folder made by :func:`materialize` (its config.json holds ``RECIPE_KEY``)."""
    cfg = read_config(model_dir)
    return isinstance(cfg, dict) and isinstance(cfg.get(RECIPE_KEY), dict)


def spec_from_folder(model_dir: str | os.PathLike) -> SyntheticSpec:
    """The :class:`SyntheticSpec` recorded in a synthetic folder's config.json.

    Raises:
        ModelLoadError: not a synthetic folder, or a recipe of an unknown format.
    """
    cfg = read_config(model_dir)
    recipe = cfg.get(RECIPE_KEY) if isinstance(cfg, dict) else None
    if not isinstance(recipe, dict):
        raise ModelLoadError(f"{model_dir} is not a synthetic model folder (config.json lacks {RECIPE_KEY!r})")
    if recipe.get("format") != RECIPE_FORMAT:
        raise ModelLoadError(f"{model_dir}: synthetic recipe format {recipe.get('format')!r} is not "
                             f"{RECIPE_FORMAT}; remove the folder and resolve the spec again")
    preset = SyntheticPreset(recipe["preset"], recipe.get("source", ""), recipe["preset_config"])
    return SyntheticSpec(preset, int(recipe["layers"]), float(recipe["skew"]), int(recipe["seed"]), None,
                         recipe.get("quant"), recipe.get("routing", ROUTER))


def _max_token_id(tokenizer_dir: Path) -> int | None:
    """Largest token id in ``tokenizer.json`` (base vocabulary and added tokens), or None without that file."""
    path = tokenizer_dir / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None
    vocab = (data.get("model") or {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    ids += [t.get("id", 0) for t in data.get("added_tokens") or []]
    return max(ids) if ids else None


def check_tokenizer(spec: SyntheticSpec) -> None:
    """Raise ModelLoadError when ``spec.tokenizer`` holds no tokenizer files or produces ids the model's
    vocabulary does not cover."""
    if spec.tokenizer is None:
        return
    tok = Path(spec.tokenizer)
    if not any((tok / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise ModelLoadError(f"--tokenizer {tok}: no tokenizer.json, tokenizer.model or tokenizer_config.json")
    top = _max_token_id(tok)
    vocab = int(spec.preset.config["vocab_size"])
    if top is not None and top >= vocab:
        raise ModelLoadError(f"--tokenizer {tok}: token ids reach {top}, beyond the vocabulary of "
                             f"{spec.preset.name} ({vocab} ids)")


def materialize(spec: SyntheticSpec, root: Path) -> Path:
    """Write (once) the folder that stands for ``spec`` under ``root``: ``config.json`` and, with a tokenizer,
    symlinks to its files (copies where links fail). Concurrent callers are safe: the folder is built under a
    temporary name and renamed into place; a loser of the race uses the winner's identical folder.

    Returns:
        ``root / "<preset>-<hash>"``, the hash covering the config and the tokenizer path.

    Raises:
        ModelLoadError: the tokenizer does not fit (:func:`check_tokenizer`) or ``root`` cannot be written.
    """
    check_tokenizer(spec)
    cfg = synthetic_config(spec)
    key = hashlib.sha256(json.dumps([cfg, spec.tokenizer], sort_keys=True).encode()).hexdigest()[:16]
    dest = root / f"{spec.preset.name}-{key}"
    if (dest / "config.json").is_file():
        return dest
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=root))
    except OSError as e:
        raise ModelLoadError(f"cannot write the model cache {root}: {e}") from None
    try:
        if spec.tokenizer is not None:
            for name in _TOKENIZER_FILES:
                src = Path(spec.tokenizer) / name
                if src.is_file():
                    try:
                        os.symlink(src, tmp / name)
                    except OSError:
                        shutil.copyfile(src, tmp / name)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / "config.json").is_file():  # not a lost race: a real failure
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelLoadError(f"cannot write the synthetic model folder {dest}: {e}") from None
    return dest


def build_synthetic(spec: SyntheticSpec | str, **kwargs: Any):
    """Build the model in memory; see :func:`ferrylm.synthetic.build.build_synthetic` (imports torch)."""
    from ferrylm.synthetic.build import build_synthetic as _build

    return _build(spec, **kwargs)


def default_prompt_ids(vocab_size: int, n: int = 16) -> list[int]:
    """A fixed prompt of ``n`` token ids spread over ``[1, vocab_size)`` (for ``ferry generate`` without a prompt)."""
    return [1 + (7919 * k) % (vocab_size - 1) for k in range(n)]


def describe_presets() -> list[str]:
    """``"<name>  <summary>"`` lines for ``ferry models``."""
    width = max(len(n) for n in PRESETS)
    return [f"{SYNTHETIC_PREFIX}{name:<{width}}  {p.summary()}" for name, p in PRESETS.items()]
