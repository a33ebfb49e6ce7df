"""What a GGUF file is, from its header alone (no tensor data read, no torch import): the architecture check, the
HF-style config dict, and the GGUF types of the routed experts.

Architectures: :data:`ferrylm.checkpoints.gguf_archs.ARCHS` (``general.architecture`` -> the HF class served;
``llama`` is Mixtral when ``llama.expert_count > 0``, else the dense Llama). Metadata keys: gguf-py's ``Keys``; the fields every
architecture shares are read here, the rest by :data:`ferrylm.checkpoints.gguf_arch_config.ARCH_CONFIG`. Used by the
frontend (config, tokenizer) and by :mod:`ferrylm.checkpoints.quant.gguf_file`, which loads the model from the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ferrylm.errors import ModelLoadError
from ferrylm.checkpoints.gguf_arch_config import ARCH_CONFIG, Meta
from ferrylm.checkpoints.gguf_archs import ARCHS, EXPERT_KINDS, arch_of, unsupported
from ferrylm.checkpoints.gguf_reader import GGUFFile, read_gguf

#: the routed-expert projection of each expert kind (gate and up share one format)
EXPERT_TENSORS = {kind: "down" if part == "down" else "gate_up" for kind, part in EXPERT_KINDS.items()}
GGUF_METHOD = "gguf"  # quantization_config.quant_method of a config served from a GGUF file


def is_gguf_file(path: str | Path) -> bool:
    """True when ``path`` is an existing file named ``*.gguf``."""
    p = Path(path)
    return p.suffix.lower() == ".gguf" and p.is_file()


def check_tensor_parallel(path: str | Path, tp_size: int) -> None:
    """Raises ModelLoadError when ``--tensor-parallel-size`` > 1 asks a split of a GGUF file (not loaded that way
    yet): checked by ``ferry serve`` before anything starts and by the loader."""
    if tp_size > 1 and is_gguf_file(path):
        raise ModelLoadError(f"--tensor-parallel-size {tp_size}: {Path(path).name} is a GGUF file; tensor parallel "
                             f"loads safetensors folders and synthetic models only (for now)")


def is_served_gguf(g: GGUFFile) -> bool:
    """True when ``g``'s architecture is one of :data:`~ferrylm.checkpoints.gguf_archs.ARCHS`."""
    return g.get("general.architecture") in ARCHS


def num_layers(g: GGUFFile) -> int:
    """The decoder layers of ``g``: ``block_count`` less llama.cpp's multi-token-prediction blocks
    (``nextn_predict_layers``, numbered last). Raises ModelLoadError without ``block_count``."""
    from gguf.constants import Keys

    m = Meta(g, g.get("general.architecture"))
    return m.int(Keys.LLM.BLOCK_COUNT) - m.int(Keys.LLM.NEXTN_PREDICT_LAYERS, 0)


def type_name(qtype: int) -> str:
    """GGML type number -> its name (``"Q4_K"``)."""
    from gguf.constants import GGMLQuantizationType

    return GGMLQuantizationType(qtype).name


def expert_types(g: GGUFFile) -> dict[str, list[str]]:
    """``{"gate_up": [...], "down": [...]}``: the sorted GGUF types the routed-expert stacks of each projection use
    across layers (empty lists for a file without routed experts)."""
    out: dict[str, set[str]] = {"gate_up": set(), "down": set()}
    layers = num_layers(g) if is_served_gguf(g) else 0
    for t in g.tensors:
        parts = t.name.split(".")
        if (len(parts) == 4 and parts[0] == "blk" and parts[2] in EXPERT_TENSORS and parts[3] == "weight"
                and int(parts[1]) < layers):
            out[EXPERT_TENSORS[parts[2]]].add(type_name(t.qtype))
    return {k: sorted(v) for k, v in out.items()}


def served_config(g: GGUFFile) -> dict[str, Any]:
    """The config dict a GGUF is served with: :func:`config_from_gguf`, ``torch_dtype`` bfloat16 (the
    non-expert tensors take the model dtype at load), and ``quantization_config`` ``{"quant_method": "gguf",
    "gguf_types": expert_types(g)}`` (the memory plan sizes the experts from it before loading).

    Raises:
        ModelLoadError: an architecture not served, or as :func:`config_from_gguf`.
    """
    if not is_served_gguf(g):
        raise unsupported(g.path, g.get("general.architecture"))
    cfg = config_from_gguf(g)
    cfg["torch_dtype"] = "bfloat16"
    types = expert_types(g)
    if any(types.values()) and not set(types["gate_up"] + types["down"]) <= {"F32", "F16", "BF16"}:
        cfg["quantization_config"] = {"quant_method": GGUF_METHOD, "gguf_types": types}
    return cfg


def gguf_config(path: str | Path) -> dict[str, Any]:
    """:func:`served_config` of the GGUF file ``path`` (reads its header). Raises ModelLoadError."""
    return served_config(read_gguf(path))


def config_from_gguf(g: GGUFFile) -> dict[str, Any]:
    """A HF config.json dict for a GGUF: the shared fields (shapes, norms, RoPE and its scaling, partial rotary
    as ``rotary_dim``, tokens) and the architecture's own (``ARCH_CONFIG``).

    Raises:
        ModelLoadError: an architecture not served, a required metadata key missing, a per-layer value, a RoPE
            scaling other than linear / yarn, or what the architecture's fields refuse.
    """
    from gguf.constants import Keys

    arch = arch_of(g)
    m = Meta(g, arch.name)
    k, a = Keys.LLM, Keys.Attention
    hidden, heads = m.int(k.EMBEDDING_LENGTH), m.int(a.HEAD_COUNT)
    head_dim = m.int(a.KEY_LENGTH, hidden // heads)
    theta = m.float(Keys.Rope.FREQ_BASE, 10000.0)
    tokens = g.get("tokenizer.ggml.tokens")
    cfg: dict[str, Any] = {
        "architectures": [arch.hf_class], "hidden_size": hidden, "num_hidden_layers": num_layers(g),
        "num_attention_heads": heads, "num_key_value_heads": m.int(a.HEAD_COUNT_KV, heads), "head_dim": head_dim,
        "vocab_size": m.int(k.VOCAB_SIZE, len(tokens) if tokens is not None else 0),
        "max_position_embeddings": m.int(k.CONTEXT_LENGTH), "rms_norm_eps": m.float(a.LAYERNORM_RMS_EPS),
        "rope_theta": theta, "rope_parameters": _rope_parameters(m, theta),
        "rotary_dim": m.int(Keys.Rope.DIMENSION_COUNT, head_dim), "hidden_act": "silu",
        "tie_word_embeddings": not m.has("output.weight"), "torch_dtype": "float32",
        "num_experts_per_tok": m.int(k.EXPERT_USED_COUNT, 0), "attention_dropout": 0.0,
        "_experts": m.int(k.EXPERT_COUNT, 0),
    }
    if cfg["rms_norm_eps"] is None:
        raise ModelLoadError(f"{g.path}: GGUF metadata lacks '{a.LAYERNORM_RMS_EPS.format(arch=arch.name)}'")
    ARCH_CONFIG[arch.name](m, cfg)
    for gguf_key, hf_key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        v = g.get(f"tokenizer.ggml.{gguf_key}_token_id")
        if v is not None:
            cfg[hf_key] = int(v)
    return cfg


def _rope_parameters(m: Meta, theta: float) -> dict[str, Any]:
    """``rope_parameters`` from ``rope.scaling.*``: default, linear or yarn. Raises ModelLoadError for another
    scaling type."""
    from gguf.constants import Keys

    r = Keys.Rope
    kind = m.get(r.SCALING_TYPE)
    if kind in (None, "none"):
        return {"rope_type": "default", "rope_theta": theta}
    params: dict[str, Any] = {"rope_type": kind, "rope_theta": theta, "factor": m.float(r.SCALING_FACTOR, 1.0)}
    if kind == "yarn":
        params["original_max_position_embeddings"] = m.int(r.SCALING_ORIG_CTX_LEN)
        for key, name in ((r.SCALING_YARN_BETA_FAST, "beta_fast"), (r.SCALING_YARN_BETA_SLOW, "beta_slow"),
                          (r.SCALING_YARN_ATTN_FACTOR, "attention_factor")):
            if (v := m.float(key)) is not None:
                params[name] = v
    elif kind != "linear":
        raise ModelLoadError(f"{m.g.path}: RoPE scaling {kind!r} is not supported (linear, yarn)")
    return params
