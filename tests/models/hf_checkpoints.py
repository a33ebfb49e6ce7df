"""Helpers for tests/models: tiny random checkpoints written by transformers' own ``save_pretrained``, plus the in-memory reference model.

Each case is built once per session. Parameters are re-drawn with a larger spread than transformers' default
init (std 0.02), so that logits, RoPE and routing decisions are far from degenerate and a wrong formula shows.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)

CASES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", dict(vocab_size=160, intermediate_size=128,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "llama_llama3": ("llama", dict(vocab_size=160, intermediate_size=128, max_position_embeddings=512,
                                   rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 64})),
    "llama_linear": ("llama", dict(vocab_size=160, intermediate_size=128,
                                   rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "llama_yarn": ("llama", dict(vocab_size=160, intermediate_size=128,
                                 rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                  "original_max_position_embeddings": 64})),
    # tied embeddings, q/k/v/o + MLP biases, head_dim (32) != hidden / heads (16), 3 layers
    "llama_tied_bias": ("llama", dict(vocab_size=192, intermediate_size=96, num_hidden_layers=3, head_dim=32,
                                      tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "mixtral": ("mixtral", dict(vocab_size=128, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2,
                                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "mixtral_tied": ("mixtral", dict(vocab_size=200, intermediate_size=48, num_hidden_layers=3,
                                     num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=True,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # layer 0 dense (mlp_only_layers), layers 1-2 MoE; renormalised top-3; head_dim 32 != 64 / 4
    "qwen3_moe": ("qwen3_moe", dict(vocab_size=160, intermediate_size=96, moe_intermediate_size=48,
                                    num_hidden_layers=3, head_dim=32, num_experts=8, num_experts_per_tok=3,
                                    norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # decoder_sparse_step 2: layers 1 and 3 MoE, 0 and 2 dense; raw top-2 softmax weights (no renormalisation)
    "qwen3_moe_step2": ("qwen3_moe", dict(vocab_size=128, intermediate_size=80, moe_intermediate_size=32,
                                          num_hidden_layers=4, head_dim=16, num_experts=6, num_experts_per_tok=2,
                                          norm_topk_prob=False, decoder_sparse_step=2,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # shared expert with sigmoid gate, qkv bias, raw top-2 weights
    "qwen2_moe": ("qwen2_moe", dict(vocab_size=160, intermediate_size=96, moe_intermediate_size=40,
                                    shared_expert_intermediate_size=80, num_experts=8, num_experts_per_tok=2,
                                    norm_topk_prob=False,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # renormalised top-4, layer 1 dense, tied embeddings
    "qwen2_moe_mixed": ("qwen2_moe", dict(vocab_size=144, intermediate_size=72, moe_intermediate_size=24,
                                          shared_expert_intermediate_size=56, num_hidden_layers=3, num_experts=6,
                                          num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[1],
                                          tie_word_embeddings=True,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "olmoe": ("olmoe", dict(vocab_size=160, intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                            norm_topk_prob=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # clip_qkv small enough to clamp a good share of q/k/v entries; renormalised top-3; MHA (4 kv heads)
    "olmoe_clip": ("olmoe", dict(vocab_size=128, intermediate_size=32, num_key_value_heads=4, num_experts=6,
                                 num_experts_per_tok=3, norm_topk_prob=True, clip_qkv=0.8,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # GLM-4.5 shape: layer 0 dense (first_k_dense_replace), group-limited top-3 (4 groups of 2, best 2 groups),
    # renormalised and scaled, one shared expert, q/k/v biases, per-head q/k norm, half the head rotated
    "glm4_moe": ("glm4_moe", dict(vocab_size=160, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                                  head_dim=32, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                                  routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1,
                                  first_k_dense_replace=1, attention_bias=True, use_qk_norm=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "partial_rotary_factor": 0.5})),
    # GLM-4.5-Air shape: no q/k norm, plain top-2 (one group), raw sigmoid weights, two shared experts fused,
    # every layer MoE, a quarter of the head rotated. The factor is stated at the top level too: transformers 5.17's
    # Glm4MoeConfig lets its top-level default (0.5) override the one inside rope_parameters (5.2x does not)
    "glm4_moe_air": ("glm4_moe", dict(vocab_size=144, intermediate_size=64, moe_intermediate_size=24, head_dim=16,
                                      n_routed_experts=6, num_experts_per_tok=2, n_group=1, topk_group=1,
                                      routed_scaling_factor=1.0, norm_topk_prob=False, n_shared_experts=2,
                                      first_k_dense_replace=0, attention_bias=False, use_qk_norm=False,
                                      partial_rotary_factor=0.25,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                       "partial_rotary_factor": 0.25})),
    # MiniMax-M2 shape: q/k norm over the whole projection, rotary_dim 16 of head_dim 32, biased sigmoid top-2. The
    # published field is rotary_dim; transformers 5.17 ignores it (rotates the whole head; 5.2x converts it), so the
    # factor it implies is stated in rope_parameters as well
    "minimax_m2": ("minimax_m2", dict(vocab_size=160, intermediate_size=48, head_dim=32, num_local_experts=8,
                                      num_experts_per_tok=2, rotary_dim=16,
                                      rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                                       "partial_rotary_factor": 0.5})),
    # Qwen3-Next: layers linear, full, linear, linear (layer_types); layer 3 dense (mlp_only_layers); GVA (2 key
    # heads for 4 value heads); a quarter of the head rotated; renormalised top-2 and a gated shared expert
    "qwen3_next": ("qwen3_next", dict(vocab_size=160, intermediate_size=96, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                                      norm_topk_prob=True, head_dim=32, num_hidden_layers=4, mlp_only_layers=[3],
                                      layer_types=["linear_attention", "full_attention", "linear_attention",
                                                   "linear_attention"],
                                      linear_num_key_heads=2, linear_key_head_dim=16, linear_num_value_heads=4,
                                      linear_value_head_dim=8, linear_conv_kernel_dim=4,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.25})),
    # Qwen3.5-MoE text model: four DeltaNet projections, full_attention_interval 2 (layers 1 and 3 full), half the
    # head rotated, equal key and value heads, top-3
    "qwen3_5_moe": ("qwen3_5_moe", dict(vocab_size=144, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                        num_experts=6, num_experts_per_tok=3, head_dim=16, num_hidden_layers=4,
                                        full_attention_interval=2, linear_num_key_heads=2, linear_key_head_dim=16,
                                        linear_num_value_heads=2, linear_value_head_dim=16, linear_conv_kernel_dim=3,
                                        # top level too: transformers 5.17 reads its top-level default 0.25 over
                                        # rope_parameters' factor
                                        partial_rotary_factor=0.5,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                         "partial_rotary_factor": 0.5})),
    # Qwen4-Exp text model (Qwen3.8-Flash-Next): layers linear, indexed, linear, indexed; 3 residual streams; an
    # indexer of 4 heads keeping 2 blocks of 4 tokens (sparse from the 12th token on); GVA; sigmoid output gate
    "qwen4_exp": ("qwen4_exp", dict(vocab_size=144, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                    num_experts=6, num_experts_per_tok=3, head_dim=16, num_hidden_layers=4,
                                    full_attention_interval=2, linear_num_key_heads=2, linear_key_head_dim=16,
                                    linear_num_value_heads=4, linear_value_head_dim=8, linear_conv_kernel_dim=3,
                                    hc_count=3, hc_lowrank=12, indexer_n_heads=4, indexer_kv_heads=1,
                                    indexer_head_dim=24, indexer_budget=8, indexer_compress_ratio=4,
                                    output_gate_type="sigmoid", partial_rotary_factor=0.5,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                     "partial_rotary_factor": 0.5})),
    # ... with per-layer embeddings on layers 0 and 2 (one-indexed 1 and 3): 2 heads per n-gram order up to 3-grams,
    # tables of ~300 rows in 2 shards each, a 3-tap convolution 3 tokens apart
    "qwen4_exp_ple": ("qwen4_exp", dict(vocab_size=144, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                        num_experts=6, num_experts_per_tok=3, head_dim=16, num_hidden_layers=4,
                                        full_attention_interval=2, linear_num_key_heads=2, linear_key_head_dim=16,
                                        linear_num_value_heads=4, linear_value_head_dim=8, linear_conv_kernel_dim=3,
                                        hc_count=3, hc_lowrank=12, indexer_n_heads=4, indexer_kv_heads=1,
                                        indexer_head_dim=24, indexer_budget=8, indexer_compress_ratio=4,
                                        ple_layer_ids=[1, 3], ple_embed_dim=32, ple_conv_kernel_size=3, ngram_size=3,
                                        heads_per_ngram=2, ngram_vocab_size_base=50,
                                        make_ngram_vocab_size_divisible_by=8, split_ngram_parts=2,
                                        partial_rotary_factor=0.5,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                         "partial_rotary_factor": 0.5})),
    # DeepSeek-V3 shape: MLA with a low-rank query (q_lora_rank), v_head_dim != qk_nope_head_dim, interleaved
    # rope over 8 dims with yarn (mscale_all_dim in the softmax scale), layers 0-1 dense, 2-3 group-limited top-3
    # (4 groups of 2, best 2), renormalised and scaled, one shared expert
    "deepseek_v3": ("deepseek_v3", dict(vocab_size=160, intermediate_size=96, moe_intermediate_size=32,
                                        num_hidden_layers=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
                                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8,
                                        num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                        norm_topk_prob=True, n_shared_experts=1, first_k_dense_replace=2,
                                        rope_interleave=True,
                                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                         "original_max_position_embeddings": 64, "mscale": 1.0,
                                                         "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1})),
    # DeepSeek-V2-Lite shape: q_lora_rank null (one q_proj), attention biases, half-split rope, plain top-2 of one
    # group, raw sigmoid weights, two shared experts, layer 0 dense
    "deepseek_v3_lite": ("deepseek_v3", dict(vocab_size=144, intermediate_size=80, moe_intermediate_size=32,
                                             num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=None,
                                             kv_lora_rank=16, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                                             n_routed_experts=6, num_experts_per_tok=2, n_group=1, topk_group=1,
                                             routed_scaling_factor=1.0, norm_topk_prob=False, n_shared_experts=2,
                                             first_k_dense_replace=1, attention_bias=True, rope_interleave=False,
                                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # gpt-oss shape: sinks, layers sliding (window 5), full, sliding; yarn without truncation; biased router and
    # experts, a clamp small enough to bite, gate/up interleaved and transposed on disk
    "gpt_oss": ("gpt_oss", dict(vocab_size=160, intermediate_size=32, head_dim=16, num_hidden_layers=3,
                                num_local_experts=8, num_experts_per_tok=2, sliding_window=5, swiglu_limit=0.6,
                                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                                 "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                 "original_max_position_embeddings": 64})),
    # DeepSeek-V4 shape: layers sliding, CSA (rate 4, indexer top-3), HCA (rate 8), CSA; a window of 6; three
    # hyper-connection streams; two hash layers then top-2 sqrt-softplus routing; a clamp small enough to bite;
    # yarn on the compressed branch; rope over 8 of 32 dims; grouped output projection (2 groups); 16 indexer heads,
    # so that no indexer score is an exact tie (all heads' ReLU at zero), whose order is the implementation's
    "deepseek_v4": ("deepseek_v4", dict(vocab_size=160, moe_intermediate_size=32, num_hidden_layers=4,
                                        num_key_value_heads=1, head_dim=32, q_lora_rank=48, partial_rotary_factor=0.25,
                                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                        routed_scaling_factor=1.5, hc_mult=3, hc_sinkhorn_iters=5, swiglu_limit=0.6,
                                        layer_types=["sliding_attention", "compressed_sparse_attention",
                                                     "heavily_compressed_attention", "compressed_sparse_attention"],
                                        compress_rates={"compressed_sparse_attention": 4,
                                                        "heavily_compressed_attention": 8},
                                        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], sliding_window=6,
                                        o_groups=2, o_lora_rank=24, index_n_heads=16, index_head_dim=16, index_topk=3,
                                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32,
                                                         "beta_slow": 1, "original_max_position_embeddings": 64})),
    "qwen2": ("qwen2", dict(vocab_size=160, intermediate_size=96,
                            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3": ("qwen3", dict(vocab_size=160, intermediate_size=96, head_dim=32, tie_word_embeddings=True,
                            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}

CONFIG_CLASSES = {
    "llama": "LlamaConfig", "mixtral": "MixtralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
    "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig", "olmoe": "OlmoeConfig",
    "glm4_moe": "Glm4MoeConfig", "minimax_m2": "MiniMaxM2Config", "qwen3_next": "Qwen3NextConfig",
    "qwen3_5_moe": "Qwen3_5MoeTextConfig", "deepseek_v3": "DeepseekV3Config", "gpt_oss": "GptOssConfig",
    "qwen4_exp": "Qwen4ExpTextConfig", "deepseek_v4": "DeepseekV4Config",
}
MOE_FAMILIES = frozenset({"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "minimax_m2", "qwen3_next",
                          "qwen3_5_moe", "deepseek_v3", "gpt_oss", "qwen4_exp", "deepseek_v4"})


def is_moe_case(case: str) -> bool:
    return CASES[case][0] in MOE_FAMILIES


@dataclass
class Checkpoint:
    path: Path
    reference: torch.nn.Module  # transformers model holding the same weights (float32, eval)
    vocab_size: int


def _randomize_(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    # Qwen3-Next's norms scale by (1 + w): drawn around 0 so they scale by about 1, like the others' around 1 (the
    # gated norm of its DeltaNet layers is a plain weight)
    zero_centred = getattr(model.config, "model_type", "") in ("qwen3_next", "qwen3_5_moe_text", "qwen4_exp_text")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and zero_centred and "linear_attn.norm" not in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith((".gate.weight", ".router.weight")):  # router: decisive, well-separated choices
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            if name.endswith("linear_attn.A_log"):  # Gated DeltaNet: slow decay, so the state carries far
                p.copy_(torch.empty(p.shape).uniform_(0.01, 0.3, generator=g).log())
            elif name.endswith("linear_attn.dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g) - 2.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # sigmoid routers: a bias that changes the choice
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
            elif name.endswith("tid2eid"):  # hash routing (DeepSeek-V4): k distinct experts per token
                experts = model.config.num_local_experts
                b.copy_(torch.stack([torch.randperm(experts, generator=g)[:b.shape[1]] for _ in range(b.shape[0])]))


def build_checkpoint(case: str, path: Path, seed: int = 0, **config: object) -> Checkpoint:
    """``case`` of :data:`CASES` with random weights, saved under ``path``; ``config`` overrides its fields (the
    model is built with them, unlike :func:`copy_config`)."""
    family, overrides = CASES[case]
    config_cls = getattr(transformers, CONFIG_CLASSES[family])
    cfg = config_cls(**{**_COMMON, **overrides, **config})
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    _randomize_(model, seed)
    model.eval()
    model.save_pretrained(path)
    return Checkpoint(path=path, reference=model, vocab_size=cfg.vocab_size)


def copy_config(src: Path, dst: Path, **updates) -> Path:
    """Copy ``src/config.json`` to ``dst`` (created), applying top-level ``updates``."""
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(updates)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def reference_logits(ckpt: Checkpoint, ids: torch.Tensor) -> torch.Tensor:
    """Full-sequence float32 logits ``[T, V]`` from transformers."""
    with torch.no_grad():
        return ckpt.reference(input_ids=ids[None]).logits[0].float()


def token_ids(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _cache_argument(reference) -> str:
    """The name transformers' ``forward`` gives its KV cache: ``cache`` from 5.2x, ``past_key_values`` before (the
    GPU machine has 5.17). Passed under the wrong name it lands in ``**kwargs`` and is ignored silently, so every
    step would see only its own token."""
    import inspect

    params = inspect.signature(reference.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def hf_greedy(reference, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation through its own KV cache (``generate`` would suppress or stop at EOS; the
    tiny random models pick it). ``n`` tokens; works on transformers 5.17 and 5.2x."""
    from transformers import DynamicCache

    # DeepSeek-V4's reference needs its own cache layers (compressor state), which only a config-built cache has
    own = getattr(reference.config, "model_type", "") == "deepseek_v4"
    out, cache, ids = [], DynamicCache(config=reference.config) if own else DynamicCache(), torch.tensor([prompt])
    name = _cache_argument(reference)
    with torch.no_grad():
        for _ in range(n):
            logits = reference(input_ids=ids, use_cache=True, **{name: cache}).logits[0, -1]
            out.append(int(torch.argmax(logits)))
            ids = torch.tensor([[out[-1]]])
    return out
