"""What a Mixture-of-Experts GGUF file is, from its header alone (no tensor data read, no torch import): the
architecture check, the HF-style config dict, and the GGUF types of the routed experts.

Architectures (GGUF ``general.architecture`` -> HF class): ``qwen3moe`` -> Qwen3MoeForCausalLM, ``qwen2moe`` ->
Qwen2MoeForCausalLM, ``olmoe`` -> OlmoeForCausalLM, ``llama`` with ``llama.expert_count > 0`` (Mixtral) ->
MixtralForCausalLM. Metadata keys: gguf-py's ``constants.py`` (``Keys.LLM``). Used by the frontend (config,
tokenizer) and by :mod:`ferrylm.checkpoints.quant.gguf_file`, which loads the model from the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ferrylm.errors import ModelLoadError
from ferrylm.checkpoints.gguf_convert import GGUFFile, _f32_clean, read_gguf

MOE_ARCHS = {"qwen3moe": "Qwen3MoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
             "llama": "MixtralForCausalLM"}
#: the stacked routed-expert tensors ``blk.N.<name>.weight`` -> projection (gate and up share one format)
EXPERT_TENSORS = {"ffn_gate_exps": "gate_up", "ffn_up_exps": "gate_up", "ffn_down_exps": "down"}
GGUF_METHOD = "gguf"  # quantization_config.quant_method of a config served from a GGUF file


def is_gguf_file(path: str | Path) -> bool:
    """True when ``path`` is an existing file named ``*.gguf``."""
    p = Path(path)
    return p.suffix.lower() == ".gguf" and p.is_file()


def is_moe_gguf(g: GGUFFile) -> bool:
    """True when ``g`` is one of the MoE layouts in the module docstring."""
    arch = g.get("general.architecture")
    return arch in MOE_ARCHS and (arch != "llama" or int(g.get("llama.expert_count", 0) or 0) > 0)


def type_name(qtype: int) -> str:
    """GGML type number -> its name (``"Q4_K"``)."""
    from gguf.constants import GGMLQuantizationType

    return GGMLQuantizationType(qtype).name


def expert_types(g: GGUFFile) -> dict[str, list[str]]:
    """``{"gate_up": [...], "down": [...]}``: the sorted GGUF types the routed-expert stacks of each projection use
    across layers (empty lists for a file without routed experts)."""
    out: dict[str, set[str]] = {"gate_up": set(), "down": set()}
    for t in g.tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in EXPERT_TENSORS:
            out[EXPERT_TENSORS[parts[2]]].add(type_name(t.qtype))
    return {k: sorted(v) for k, v in out.items()}


def served_config(g: GGUFFile) -> dict[str, Any]:
    """The config dict a MoE GGUF is served with: :func:`moe_config_from_gguf`, ``torch_dtype`` bfloat16 (the
    non-expert tensors take the model dtype at load), and ``quantization_config`` ``{"quant_method": "gguf",
    "gguf_types": expert_types(g)}`` (the memory plan sizes the experts from it before loading).

    Raises:
        ModelLoadError: not a MoE GGUF, or as :func:`moe_config_from_gguf`.
    """
    if not is_moe_gguf(g):
        raise ModelLoadError(f"{g.path}: GGUF architecture {g.get('general.architecture')!r} is not a MoE layout "
                             f"served from the file ({', '.join(MOE_ARCHS)})")
    cfg = moe_config_from_gguf(g)
    cfg["torch_dtype"] = "bfloat16"
    types = expert_types(g)
    if any(types.values()) and not set(types["gate_up"] + types["down"]) <= {"F32", "F16", "BF16"}:
        cfg["quantization_config"] = {"quant_method": GGUF_METHOD, "gguf_types": types}
    return cfg


def gguf_config(path: str | Path) -> dict[str, Any]:
    """:func:`served_config` of the GGUF file ``path`` (reads its header). Raises ModelLoadError."""
    return served_config(read_gguf(path))


def moe_config_from_gguf(g: GGUFFile) -> dict[str, Any]:
    """A HF config.json dict for a MoE GGUF (see the module docstring for the architectures).

    Raises:
        ModelLoadError: a required metadata key is missing, or a feature not converted (RoPE scaling, partial
            rotary, per-layer head counts).
    """
    arch = g.get("general.architecture")

    def key(name: str, default: Any = None, required: bool = True) -> Any:
        v = g.get(f"{arch}.{name}", default)
        if v is None and required:
            raise ModelLoadError(f"{g.path}: GGUF metadata lacks '{arch}.{name}'")
        if isinstance(v, np.ndarray):
            raise ModelLoadError(f"{g.path}: per-layer '{arch}.{name}' is not supported")
        return v

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    if int(key("rope.dimension_count", head_dim)) != head_dim:
        raise ModelLoadError(f"{g.path}: partial rotary embeddings are not supported")
    scaling = key("rope.scaling.type", None, required=False)
    if scaling not in (None, "none"):
        raise ModelLoadError(f"{g.path}: RoPE scaling {scaling!r} is not supported by the GGUF converter")
    tokens = g.get("tokenizer.ggml.tokens")
    vocab = int(key("vocab_size", None, required=False) or (len(tokens) if tokens is not None else 0))
    names = {t.name for t in g.tensors}
    layers = int(key("block_count"))
    experts, used = int(key("expert_count")), int(key("expert_used_count"))
    cfg: dict[str, Any] = {
        "architectures": [MOE_ARCHS[arch]], "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim, "vocab_size": vocab, "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": _f32_clean(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32_clean(key("rope.freq_base", 10000.0)), "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names, "torch_dtype": "float32",
        "num_experts_per_tok": used, "attention_dropout": 0.0,
    }
    moe_width = key("expert_feed_forward_length", None, required=False)
    dense_width = int(key("feed_forward_length", 0, required=False) or 0)
    if arch == "llama":
        cfg.update(model_type="mixtral", num_local_experts=experts, intermediate_size=int(moe_width or dense_width),
                   sliding_window=None)
    else:
        sparse = [i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" in names]
        cfg.update(num_experts=experts, moe_intermediate_size=int(moe_width or dense_width),
                   intermediate_size=dense_width or int(moe_width or 0))
        if arch == "qwen3moe":
            cfg.update(model_type="qwen3_moe", norm_topk_prob=True, decoder_sparse_step=1, attention_bias=False,
                       mlp_only_layers=[i for i in range(layers) if i not in sparse])
        elif arch == "qwen2moe":
            cfg.update(model_type="qwen2_moe", norm_topk_prob=False, decoder_sparse_step=1,
                       mlp_only_layers=[i for i in range(layers) if i not in sparse],
                       shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length")))
        else:
            cfg.update(model_type="olmoe", norm_topk_prob=False, clip_qkv=None, attention_bias=False)
    for gguf_key, hf_key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        v = g.get(f"tokenizer.ggml.{gguf_key}_token_id")
        if v is not None:
            cfg[hf_key] = int(v)
    return cfg
