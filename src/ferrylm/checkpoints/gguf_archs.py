"""The GGUF architectures ferrylm serves, one table each: llama.cpp's tensor names -> the HF weight names of
ferrylm's model, and the values changes llama.cpp's ``convert_hf_to_gguf.py`` made, undone.

Names come from gguf-py's ``constants.py`` (``MODEL_ARCH_NAMES``, ``TENSOR_NAMES`` by ``MODEL_TENSOR`` member);
the tables below name members, so an architecture the installed gguf-py does not know is left out (and named in
the error a file of it gets). A GGUF tensor is ``blk.N.<kind>[.weight|.bias]`` or a global one (``token_embd``,
``output_norm``, ``output``); routed experts (``ffn_{gate,up,down}_exps``) are :data:`EXPERT_KINDS`, read by
the loader as stacks. Layers numbered ``num_hidden_layers`` or more (llama.cpp's multi-token-prediction blocks,
``nextn_predict_layers``) are not read. The config side is :mod:`ferrylm.checkpoints.gguf_arch_config`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

import numpy as np

from ferrylm.errors import ModelLoadError
from ferrylm.checkpoints.gguf_reader import GGUFFile, GGUFTensor, dequantize_tensor
from ferrylm.checkpoints import gguf_fixes as fx

Fix = Callable[[np.ndarray, dict], np.ndarray]


@dataclass(frozen=True)
class Rule:
    """Where one GGUF tensor kind goes. ``hf``: the HF name inside the layer (``self_attn.q_proj``; the GGUF leaf
    ``.weight`` / ``.bias`` appended), or with ``bare`` the whole parameter name (``linear_attn.A_log``, the leaf
    dropped); global kinds name the whole tensor (``model.embed_tokens``). ``fix(w, config)`` undoes llama.cpp's
    converter on the values; ``shape(gguf shape, config)`` gives the HF shape where ``fix`` changes it."""

    hf: str
    bare: bool = False
    fix: Fix | None = None
    shape: Callable[[tuple, dict], tuple] | None = None


@dataclass(frozen=True)
class Join:
    """One HF tensor llama.cpp stores as several GGUF kinds (``parts``, same layer); ``join(arrays, config)`` puts
    it back, ``shape(shapes, config)`` is its shape. Not used where the file holds the HF tensor whole."""

    hf: str
    parts: tuple[str, ...]
    join: Callable[[list[np.ndarray], dict], np.ndarray]
    shape: Callable[[list[tuple], dict], tuple]


@dataclass(frozen=True)
class GGUFArch:
    """One architecture: ``name`` (``general.architecture``), the HF class it is served as, ``rules`` (GGUF kind
    -> :class:`Rule`), ``joins``, and ``experts`` (the HF block holding the routed experts)."""

    name: str
    hf_class: str
    rules: Mapping[str, Rule]
    joins: tuple[Join, ...] = ()
    experts: str = "mlp"


@dataclass(frozen=True)
class HFTensor:
    """A non-expert HF tensor of the file: its name, shape and GGUF sources; ``produce(data)`` dequantizes them
    (float32, PyTorch order) and undoes the converter's changes. ``data`` is the whole file as uint8. ``verbatim``:
    one source whose values are the tensor's unchanged (no fix, no join), so its stored bytes may serve as is."""

    name: str
    shape: tuple[int, ...]
    sources: tuple[GGUFTensor, ...]
    produce: Callable[[np.ndarray], np.ndarray] = field(repr=False)
    verbatim: bool = False


@dataclass(frozen=True)
class ExpertTensor:
    """A routed-expert stack: decoder ``layer``, ``part`` (``gate`` / ``up`` / ``down``), ``leaf`` (``weight``,
    or ``bias`` for gpt-oss) and the GGUF tensor (``[E, N, K]`` weights, ``[E, N]`` biases)."""

    layer: int
    part: str
    leaf: str
    tensor: GGUFTensor


# --------------------------------------------------------------------------------------------------------------
# The tables (MODEL_TENSOR member name -> rule)
# --------------------------------------------------------------------------------------------------------------

_Q, _K = Rule("self_attn.q_proj"), Rule("self_attn.k_proj")
_GLOBAL = {"TOKEN_EMBD": Rule("model.embed_tokens"), "OUTPUT_NORM": Rule("model.norm"), "OUTPUT": Rule("lm_head")}
_ATTN = {"ATTN_NORM": Rule("input_layernorm"), "ATTN_Q": _Q, "ATTN_K": _K, "ATTN_V": Rule("self_attn.v_proj"),
         "ATTN_OUT": Rule("self_attn.o_proj")}
_QK_NORM = {"ATTN_Q_NORM": Rule("self_attn.q_norm"), "ATTN_K_NORM": Rule("self_attn.k_norm")}
_FFN_NORM = {"FFN_NORM": Rule("post_attention_layernorm")}
_POST_NORM = {"ATTN_POST_NORM": Rule("post_attention_layernorm")}
_DENSE = {"FFN_GATE": Rule("mlp.gate_proj"), "FFN_UP": Rule("mlp.up_proj"), "FFN_DOWN": Rule("mlp.down_proj")}
_ROUTER = {"FFN_GATE_INP": Rule("mlp.gate")}
_SHARED = {"FFN_GATE_SHEXP": Rule("mlp.shared_expert.gate_proj"), "FFN_UP_SHEXP": Rule("mlp.shared_expert.up_proj"),
           "FFN_DOWN_SHEXP": Rule("mlp.shared_expert.down_proj"),
           "FFN_GATE_INP_SHEXP": Rule("mlp.shared_expert_gate", fix=fx.as_row, shape=fx.row_shape)}
_SHARED_PLURAL = {"FFN_GATE_SHEXP": Rule("mlp.shared_experts.gate_proj"),
                  "FFN_UP_SHEXP": Rule("mlp.shared_experts.up_proj"),
                  "FFN_DOWN_SHEXP": Rule("mlp.shared_experts.down_proj")}
_SCORE_BIAS = {"FFN_EXP_PROBS_B": Rule("mlp.gate.e_score_correction_bias", bare=True)}

_ZERO_CENTRED = {m: Rule(r.hf, fix=fx.minus_one) for m, r in {
    "OUTPUT_NORM": _GLOBAL["OUTPUT_NORM"], "ATTN_NORM": _ATTN["ATTN_NORM"], **_POST_NORM, **_QK_NORM}.items()}
_HYBRID = {**_GLOBAL, **_ATTN, **_ROUTER, **_SHARED, **_ZERO_CENTRED,
           "SSM_NORM": Rule("linear_attn.norm"), "SSM_DT": Rule("linear_attn.dt_bias", bare=True),
           "SSM_A": Rule("linear_attn.A_log", bare=True, fix=fx.a_log),
           "SSM_CONV1D": Rule("linear_attn.conv1d", fix=fx.conv_weight, shape=fx.conv_shape),
           "SSM_OUT": Rule("linear_attn.out_proj")}
_QWEN3NEXT = {**_HYBRID, "SSM_BETA_ALPHA": Rule("linear_attn.in_proj_ba")}
_QWEN35 = {**_HYBRID, "ATTN_QKV": Rule("linear_attn.in_proj_qkv", fix=fx.qkv_rows),
           "ATTN_GATE": Rule("linear_attn.in_proj_z", fix=fx.value_rows),
           "SSM_ALPHA": Rule("linear_attn.in_proj_a", fix=fx.head_rows),
           "SSM_BETA": Rule("linear_attn.in_proj_b", fix=fx.head_rows),
           "SSM_DT": Rule("linear_attn.dt_bias", bare=True, fix=fx.head_rows),
           "SSM_A": Rule("linear_attn.A_log", bare=True, fix=fx.a_log_heads),
           "SSM_CONV1D": Rule("linear_attn.conv1d", fix=fx.conv_heads, shape=fx.conv_shape),
           "SSM_OUT": Rule("linear_attn.out_proj", fix=fx.value_columns)}

#: (MODEL_ARCH member, HF class, rules, joins, expert block)
_TABLES: tuple[tuple[str, str, dict, tuple, str], ...] = (
    ("QWEN3MOE", "Qwen3MoeForCausalLM", {**_GLOBAL, **_ATTN, **_QK_NORM, **_FFN_NORM, **_DENSE, **_ROUTER}, (), "mlp"),
    ("QWEN2MOE", "Qwen2MoeForCausalLM", {**_GLOBAL, **_ATTN, **_FFN_NORM, **_DENSE, **_ROUTER, **_SHARED}, (), "mlp"),
    ("OLMOE", "OlmoeForCausalLM", {**_GLOBAL, **_ATTN, **_QK_NORM, **_FFN_NORM, **_ROUTER}, (), "mlp"),
    ("GLM4_MOE", "Glm4MoeForCausalLM", {**_GLOBAL, **_ATTN, **_QK_NORM, **_POST_NORM, **_DENSE, **_ROUTER,
                                          **_SHARED_PLURAL, **_SCORE_BIAS}, (), "mlp"),
    ("DEEPSEEK2", "DeepseekV3ForCausalLM",
     {**_GLOBAL, "ATTN_NORM": Rule("input_layernorm"), **_FFN_NORM, "ATTN_Q": _Q,
      "ATTN_Q_A": Rule("self_attn.q_a_proj"), "ATTN_Q_A_NORM": Rule("self_attn.q_a_layernorm"),
      "ATTN_Q_B": Rule("self_attn.q_b_proj"), "ATTN_KV_A_MQA": Rule("self_attn.kv_a_proj_with_mqa"),
      "ATTN_KV_A_NORM": Rule("self_attn.kv_a_layernorm"), "ATTN_KV_B": Rule("self_attn.kv_b_proj"),
      "ATTN_OUT": Rule("self_attn.o_proj"), **_DENSE, **_ROUTER, **_SHARED_PLURAL, **_SCORE_BIAS},
     (Join("self_attn.kv_b_proj.weight", ("ATTN_K_B", "ATTN_V_B"), fx.join_kv_b, fx.kv_b_shape),), "mlp"),
    ("GPT_OSS", "GptOssForCausalLM", {**_GLOBAL, **_ATTN, **_POST_NORM, "FFN_GATE_INP": Rule("mlp.router"),
                                        "ATTN_SINKS": Rule("self_attn.sinks", bare=True)}, (), "mlp"),
    ("MINIMAXM2", "MiniMaxM2ForCausalLM",
     {**_GLOBAL, **_ATTN, **_QK_NORM, **_FFN_NORM, "FFN_GATE_INP": Rule("block_sparse_moe.gate"),
      "FFN_EXP_PROBS_B": Rule("block_sparse_moe.e_score_correction_bias", bare=True)}, (), "block_sparse_moe"),
    ("QWEN3NEXT", "Qwen3NextForCausalLM", _QWEN3NEXT,
     (Join("linear_attn.in_proj_qkvz.weight", ("ATTN_QKV", "ATTN_GATE"), fx.join_qkvz, fx.qkvz_shape),), "mlp"),
    ("QWEN35MOE", "Qwen3_5MoeForCausalLM", _QWEN35, (), "mlp"),
    ("LLAMA", "MixtralForCausalLM",  # LlamaForCausalLM without experts (gguf_arch_config)
     {**_GLOBAL, **_ATTN, **_FFN_NORM, **_DENSE, "ATTN_Q": Rule("self_attn.q_proj", fix=fx.unpermute_q),
      "ATTN_K": Rule("self_attn.k_proj", fix=fx.unpermute_k), "FFN_GATE_INP": Rule("block_sparse_moe.gate")},
     (), "block_sparse_moe"),
)

#: routed-expert stacks: MODEL_TENSOR member -> projection part
_EXPERT_MEMBERS = {"FFN_GATE_EXP": "gate", "FFN_UP_EXP": "up", "FFN_DOWN_EXP": "down"}


def _kind(member: str) -> str:
    """``MODEL_TENSOR`` member name -> the GGUF kind (``"ATTN_Q"`` -> ``"attn_q"``). Raises KeyError/AttributeError
    when the installed gguf-py lacks it."""
    from gguf.constants import MODEL_TENSOR, TENSOR_NAMES

    return TENSOR_NAMES[getattr(MODEL_TENSOR, member)].removeprefix("blk.{bid}.")


def _build() -> tuple[dict[str, GGUFArch], list[str]]:
    """The architectures the installed gguf-py knows, and the MODEL_ARCH members of those it does not."""
    from gguf.constants import MODEL_ARCH, MODEL_ARCH_NAMES

    archs: dict[str, GGUFArch] = {}
    missing: list[str] = []
    for member, hf_class, rules, joins, experts in _TABLES:
        try:
            name = MODEL_ARCH_NAMES[getattr(MODEL_ARCH, member)]
            kinds = {_kind(m): r for m, r in rules.items()}
            parts = tuple(Join(j.hf, tuple(_kind(p) for p in j.parts), j.join, j.shape) for j in joins)
        except (AttributeError, KeyError):
            missing.append(member)
            continue
        archs[name] = GGUFArch(name, hf_class, kinds, parts, experts)
    return archs, missing


ARCHS, MISSING = _build()
EXPERT_KINDS = {_kind(m): p for m, p in _EXPERT_MEMBERS.items()}
GLOBAL_KINDS = frozenset(_kind(m) for m in _GLOBAL)


def served_archs() -> list[str]:
    """The ``general.architecture`` values served: ``llama`` (dense Llama; with experts, Mixtral) and the MoE
    tables."""
    return ["llama"] + [a for a in ARCHS if a != "llama"]


def unsupported(path: object, arch: object) -> ModelLoadError:
    """The one-line error for a GGUF of an architecture that is not served."""
    try:
        have = f"gguf {version('gguf')}"
    except PackageNotFoundError:
        have = "gguf"
    unknown = f"; the installed {have} does not know {', '.join(m.lower() for m in MISSING)}" if MISSING else ""
    return ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                          f"{', '.join(served_archs())}{unknown}")


def arch_of(g: GGUFFile) -> GGUFArch:
    """The table of ``g``'s architecture. Raises ModelLoadError (:func:`unsupported`)."""
    arch = g.get("general.architecture")
    if arch not in ARCHS:
        raise unsupported(g.path, arch)
    return ARCHS[arch]


# --------------------------------------------------------------------------------------------------------------
# A file's tensors, split
# --------------------------------------------------------------------------------------------------------------

def _parse(name: str) -> tuple[int | None, str, str]:
    """``(layer or None, kind, leaf)`` of a GGUF tensor name; leaf ``""`` when it has none (``blk.0.ssm_a``)."""
    layer = None
    rest = name
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        layer, rest = int(parts[1]), parts[2]
    kind, dot, leaf = rest.rpartition(".")
    if not dot or leaf not in ("weight", "bias"):
        return layer, rest, ""
    return layer, kind, leaf


def _hf_name(arch: GGUFArch, layer: int | None, rule: Rule, leaf: str) -> str:
    base = rule.hf if rule.bare or not leaf else f"{rule.hf}.{leaf}"
    return base if layer is None else f"model.layers.{layer}.{base}"


def split_tensors(g: GGUFFile, config: dict) -> tuple[list[HFTensor], list[ExpertTensor]]:
    """The file's non-expert tensors as HF tensors and its routed-expert stacks. ``config`` is the served config
    dict (:func:`ferrylm.checkpoints.gguf_config.config_from_gguf`): its dims drive the fixes.

    Raises:
        ModelLoadError: a tensor no rule of the architecture maps (named), or a join missing one of its parts.
    """
    arch = arch_of(g)
    layers = int(config["num_hidden_layers"])
    plain: list[HFTensor] = []
    experts: list[ExpertTensor] = []
    pending: dict[tuple[int, str], GGUFTensor] = {}
    join_kinds = {p for j in arch.joins for p in j.parts}
    for t in g.tensors:
        layer, kind, leaf = _parse(t.name)
        if layer is not None and layer >= layers:
            continue  # multi-token-prediction blocks
        if (layer is None) != (kind in GLOBAL_KINDS):
            pass  # a block kind outside a block, or a global one inside: unmapped
        elif layer is not None and kind in EXPERT_KINDS and leaf:
            experts.append(ExpertTensor(layer, EXPERT_KINDS[kind], leaf, t))
            continue
        elif kind in arch.rules:
            plain.append(_single(arch, layer, arch.rules[kind], leaf, t, config))
            continue
        elif kind in join_kinds:
            pending[(layer, kind)] = t
            continue
        raise ModelLoadError(f"{g.path}: GGUF tensor {t.name!r} is not part of the {arch.name} layout ferrylm "
                             f"reads")
    plain += _joined(g, arch, pending, {h.name for h in plain}, config)
    return plain, experts


def _single(arch: GGUFArch, layer: int | None, rule: Rule, leaf: str, t: GGUFTensor, config: dict) -> HFTensor:
    shape = rule.shape(t.shape, config) if rule.shape is not None else t.shape

    def produce(data: np.ndarray) -> np.ndarray:
        w = dequantize_tensor(data, t)
        return w if rule.fix is None else rule.fix(w, config)

    return HFTensor(_hf_name(arch, layer, rule, leaf), tuple(shape), (t,), produce, verbatim=rule.fix is None)


def _joined(g: GGUFFile, arch: GGUFArch, pending: dict[tuple[int, str], GGUFTensor], have: set[str],
            config: dict) -> list[HFTensor]:
    out = []
    for layer in sorted({n for n, _ in pending}):
        for j in arch.joins:
            name = f"model.layers.{layer}.{j.hf}"
            srcs = [pending.get((layer, p)) for p in j.parts]
            if all(s is None for s in srcs) or name in have:
                continue
            if any(s is None for s in srcs):
                lack = j.parts[[s is None for s in srcs].index(True)]
                raise ModelLoadError(f"{g.path}: GGUF lacks blk.{layer}.{lack} (joined into {name})")

            def produce(data: np.ndarray, j: Join = j, srcs=tuple(srcs)) -> np.ndarray:
                return j.join([dequantize_tensor(data, s) for s in srcs], config)

            out.append(HFTensor(name, tuple(j.shape([s.shape for s in srcs], config)), tuple(srcs), produce))
    return out


def iter_expert_layers(experts: list[ExpertTensor]) -> Iterator[tuple[int, dict[tuple[str, str], GGUFTensor]]]:
    """``(layer, {(part, leaf): tensor})`` per layer with routed experts, in layer order."""
    by_layer: dict[int, dict[tuple[str, str], GGUFTensor]] = {}
    for e in experts:
        by_layer.setdefault(e.layer, {})[(e.part, e.leaf)] = e.tensor
    yield from sorted(by_layer.items())
