"""The presets of ``synthetic:<preset>``: published models' shapes, each the fields ferrylm reads of its source
repository's config.json. Data only (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
