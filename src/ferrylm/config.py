"""Configuration objects: what the model is (ModelConfig, from config.json) and how the engine runs (EngineConfig,
whose fields declare their command-line flags: ``ferrylm/flags.py``).

Frozen dataclasses passed down explicitly; no module-level mutable state. This module must stay light (no torch
import) because the CLI and the HTTP frontend import it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ferrylm.backends import ATTENTION_CHOICES, MOE_BACKENDS
from ferrylm.errors import ModelLoadError, UnsupportedArchitecture
from ferrylm.flags import flag


# --moe-cpu-kernel (ferrylm/experts/cpu_kernel.py): auto = native when it builds, else torch
CPU_KERNELS = ("auto", "native", "torch")
#: ``--moe-cache-policy`` names (experts/cache.py ``make_policy``; measured in docs/ROUTING.md)
CACHE_POLICIES = ("layer-lru", "lru", "layer-lrfu")
DECODE_GRAPH_MODES = ("auto", "off", "eager", "cuda")  # EngineConfig.decode_graphs, see engine/decode_graph.py
#: ``--ple-backend``: where per-layer embedding tables live (checkpoints/ple_tables.py; auto: engine/ple_choice.py)
PLE_BACKENDS = ("auto", "gpu", "host", "disk")
#: a ferrylm-only config.json key (never in HF checkpoints): when true, every MoE router has a bias ``gate.bias [E]``
#: added to its logits (models/moe.py); synthetic models with skew > 0 set it (synthetic/spec.py)
ROUTER_BIAS_KEY = "ferrylm_router_bias"

@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the engine and the model code need, read from a HF ``config.json``.

    Attributes:
        architecture: HF ``architectures[0]`` (e.g. ``"LlamaForCausalLM"``, ``"MixtralForCausalLM"``).
        hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim, vocab_size: shapes.
        max_position_embeddings: the model context in tokens.
        rms_norm_eps, rope_theta: numerics; ``rope_scaling`` the config's dict (or None).
        tie_word_embeddings: lm_head shares the embedding matrix.
        num_experts, num_experts_per_tok, moe_intermediate_size: MoE shape (0 for dense models).
        eos_token_ids: token ids that end generation (config ``eos_token_id``, int or list).
        raw: the whole config.json as a dict, for family-specific fields.
    """

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    eos_token_ids: tuple[int, ...] = ()
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a config.json dict.

        Raises:
            UnsupportedArchitecture: ``architectures[0]`` is not one ferrylm implements (checked first: the
                config of another kind of model lacks our fields, and "missing hidden_size" would mislead).
            ModelLoadError: a required field is missing, or a field has the wrong type (the message names it,
                its value and the type expected).
        """
        if not isinstance(d, dict):
            raise ModelLoadError(f"config.json must hold a JSON object, got {type(d).__name__}")
        d = text_model_config(d)
        arch = _architecture(d)
        read = _FieldReader(d)
        hidden = read.int("hidden_size", required=True, positive=True)
        heads = read.int("num_attention_heads", required=True, positive=True)
        layers = read.int("num_hidden_layers", required=True, positive=True)
        vocab = read.int("vocab_size", required=True, positive=True)
        eos_ids = _eos_ids(d.get("eos_token_id"))
        num_experts = read.int("num_local_experts") or read.int("num_experts") or read.int("n_routed_experts") or 0
        rope_theta, rope_scaling = _rope(d, read)
        tie = d.get("tie_word_embeddings", False)
        if not isinstance(tie, bool) and tie is not None:
            raise ModelLoadError(f"config.json field 'tie_word_embeddings' must be true or false, got {tie!r}")
        intermediate = read.int("intermediate_size") or 0
        return cls(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=read.int("num_key_value_heads") or heads,
            head_dim=read.int("head_dim") or hidden // heads,
            vocab_size=vocab,
            max_position_embeddings=read.int("max_position_embeddings") or 2048,
            rms_norm_eps=1e-6 if read.float("rms_norm_eps") is None else float(read.float("rms_norm_eps")),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(tie),
            num_experts=num_experts,
            num_experts_per_tok=(read.int("num_experts_per_tok") or 0) if num_experts else 0,
            moe_intermediate_size=(read.int("moe_intermediate_size") or intermediate) if num_experts else 0,
            eos_token_ids=eos_ids,
            raw=dict(d),
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> "ModelConfig":
        """Read ``path/config.json``, or the header of a MoE ``.gguf`` file ``path``
        (:func:`ferrylm.checkpoints.gguf_config.gguf_config`). Raises ModelLoadError naming the missing or unreadable
        file."""
        if Path(path).suffix.lower() == ".gguf" and Path(path).is_file():
            from ferrylm.checkpoints.gguf_config import gguf_config

            return cls.from_dict(gguf_config(path))
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ModelLoadError(f"{path} is not a model folder: config.json is missing")
        try:
            d = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"cannot read {p}: {e}") from None
        return cls.from_dict(_with_hf_quant_config(d, Path(path)))

def _architecture(d: dict[str, Any]) -> str:
    """``architectures[0]`` of a config dict. Raises ModelLoadError (missing, wrong type) or
    UnsupportedArchitecture (not one ferrylm implements)."""
    from ferrylm.models.registry import MODEL_REGISTRY, supported_architectures

    archs = d.get("architectures")
    if not archs:
        raise ModelLoadError("config.json has no 'architectures' field (e.g. [\"Qwen3MoeForCausalLM\"])")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ModelLoadError(f"config.json field 'architectures' must be a list of names, got {archs!r}")
    if archs[0] not in MODEL_REGISTRY:
        raise UnsupportedArchitecture(f"architecture {archs[0]!r} (config.json 'architectures') is not "
                                      f"supported; supported: {', '.join(supported_architectures())}")
    return archs[0]


def _eos_ids(eos: Any) -> tuple[int, ...]:
    """``eos_token_id`` (absent, one id or a list) as a tuple. Raises ModelLoadError naming the field."""
    if eos is None:
        return ()
    if isinstance(eos, list) and all(_is_int(t) for t in eos):
        return tuple(int(t) for t in eos)
    if _is_int(eos):
        return (int(eos),)
    raise ModelLoadError(f"config.json field 'eos_token_id' must be a token id or a list of them, got {eos!r}")


def _rope(d: dict[str, Any], read: "_FieldReader") -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)``: the top-level fields, else transformers 5's ``rope_parameters``. Raises
    ModelLoadError naming a field of the wrong type."""
    rope_params = d.get("rope_parameters") or {}
    if not isinstance(rope_params, dict):
        raise ModelLoadError(f"config.json field 'rope_parameters' must be an object, got {rope_params!r}")
    rope_theta = read.float("rope_theta")
    if rope_theta is None:
        rope_theta = _FieldReader(rope_params, "rope_parameters.").float("rope_theta") or 10000.0
    rope_scaling = d.get("rope_scaling")
    if rope_scaling is not None and not isinstance(rope_scaling, dict):
        raise ModelLoadError(f"config.json field 'rope_scaling' must be an object or null, got {rope_scaling!r}")
    if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
        rope_scaling = dict(rope_params)
    return float(rope_theta), rope_scaling



#: multimodal architectures whose text model ferrylm serves: wrapper -> the text model's architecture (its config is
#: the wrapper's ``text_config``; the loader maps ``model.language_model.*`` and skips the vision tower)
TEXT_MODEL_OF = {"Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
                 "Qwen4ExpForConditionalGeneration": "Qwen4ExpForCausalLM"}


def text_model_config(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` itself, or for a multimodal checkpoint in :data:`TEXT_MODEL_OF` its ``text_config`` as the config of
    the text model (``architectures`` renamed; ``tie_word_embeddings``, ``eos_token_id`` and
    ``quantization_config`` taken from the top level where the text config lacks them; the wrapper's name kept
    under ``ferrylm_text_model_of``)."""
    archs = d.get("architectures")
    text = d.get("text_config")
    if not (isinstance(archs, list) and archs and archs[0] in TEXT_MODEL_OF and isinstance(text, dict)):
        return d
    out = dict(text)
    for key in ("tie_word_embeddings", "eos_token_id", "quantization_config"):
        if key not in out and key in d:
            out[key] = d[key]
    out["architectures"] = [TEXT_MODEL_OF[archs[0]]]
    out["ferrylm_text_model_of"] = archs[0]
    return out


def _with_hf_quant_config(d: dict[str, Any], folder: Path) -> dict[str, Any]:
    """``d`` (config.json) with NVIDIA ModelOpt's ``hf_quant_config.json`` of ``folder`` merged in: its
    ``quantization`` fields become ``quantization_config`` (``quant_method: "modelopt"``) when config.json has none,
    or fill the fields a ``modelopt`` one lacks (older exports keep ``quant_algo`` only there). Unchanged when the
    file is absent or config.json names another method.

    Raises:
        ModelLoadError: an hf_quant_config.json that cannot be read or has no ``quantization`` object.
    """
    p = folder / "hf_quant_config.json"
    if not p.is_file():
        return d
    qcfg = d.get("quantization_config")
    if qcfg and str(qcfg.get("quant_method", "")).lower() != "modelopt":
        return d
    try:
        hf = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {p}: {e}") from None
    quant = hf.get("quantization") if isinstance(hf, dict) else None
    if not isinstance(quant, dict):
        raise ModelLoadError(f"{p} has no 'quantization' object (a ModelOpt export has one with quant_algo)")
    merged = {"quant_method": "modelopt", **quant, "producer": hf.get("producer"),
              **{k: v for k, v in (qcfg or {}).items() if v is not None}}
    return {**d, "quantization_config": merged}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer()


class _FieldReader:
    """Typed reads of config.json fields: a wrong type is a ModelLoadError naming the field, its value and what
    was expected (never a Python traceback from ``int("abc")``)."""

    def __init__(self, d: dict, prefix: str = ""):
        self.d, self.prefix = d, prefix

    def int(self, key: str, *, required: bool = False, positive: bool = False) -> int | None:
        v = self.d.get(key)
        if v is None:
            if required:
                raise ModelLoadError(f"config.json lacks required field '{self.prefix}{key}'")
            return None
        if not _is_int(v) or (positive and v <= 0) or v < 0:
            want = "a positive integer" if positive else "a non-negative integer"
            raise ModelLoadError(f"config.json field '{self.prefix}{key}' must be {want}, got {v!r}")
        return int(v)

    def float(self, key: str) -> float | None:
        v = self.d.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ModelLoadError(f"config.json field '{self.prefix}{key}' must be a number, got {v!r}")
        return float(v)


#: ``--kv-cache-dtype`` values (``engine/cache/kv_pool.py``); vLLM's ``fp8_e4m3`` is read as ``fp8``
KV_CACHE_DTYPES = ("auto", "fp8")
_KV_CACHE_SPELLINGS = {"fp8_e4m3": "fp8"}


def _kv_cache_dtype_name(name: str) -> str:
    return _KV_CACHE_SPELLINGS.get(name, name)


def _resident_for_fused(name: str) -> str:
    return "resident" if name == "fused" else name   # "fused": the vLLM / SGLang spelling


def _zero_is_off(seconds: float | None) -> float | None:
    return seconds or None


@dataclass(frozen=True)
class EngineConfig:
    """How the engine process is shaped: the serve flags that reach the engine.

    A field's flag (``ferrylm/flags.py``) is its documentation: its help is ``ferry serve --help``'s. Besides
    those: ``kv_memory_fraction``, on the CPU the most of the free host memory the automatic KV pool may take (host
    RAM is shared with everything else; on a GPU the memory plan gives the KV pool what the experts leave);
    ``decode_graphs``, ``auto`` (CUDA graphs for decode steps on a CUDA device), ``off`` (``--enforce-eager``),
    ``eager`` (the piecewise decode path without capture: tests) or ``cuda`` (``engine/decode_graph.py``).
    The model-dependent rules are :meth:`check_model`.
    """

    device: str = flag("auto", "auto | cpu | cuda[:N]")
    dtype: str = flag("auto", "auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | float16")
    page_size: int = flag(16, "tokens per KV page")
    num_pages: int | None = flag(None, "KV pool size in pages (wins over --num-tokens)",
                                 default_text="sized by the memory plan")
    num_tokens: int | None = flag(None, "KV pool size in tokens", default_text="sized by the memory plan")
    max_running_requests: int | None = flag(
        None, "requests decoded together; --max-num-seqs is vLLM's name", aliases=("--max-num-seqs",),
        default_text="what the memory plan carries: the 1024-token requests its KV pool holds, 1 to 256")
    max_prefill_length: int | None = flag(
        None, "token budget per step (prefill chunk + decodes); --max-num-batched-tokens is vLLM's name, "
              "--max-extend-length / --chunked-prefill-size SGLang's",
        aliases=("--max-extend-length", "--chunked-prefill-size", "--max-num-batched-tokens"),
        default_text="512 on CPU (a prefill chunk stalls the running streams for its length), 8192 on GPU")
    max_model_len: int | None = flag(None, "context limit in tokens", default_text="the model's")
    moe_backend: str = flag(
        "auto", "where routed experts live and run: resident (= fused) all on the device; offload: a device expert "
                "cache fed over PCIe; cpu: cache misses computed on the CPU; hybrid: misses split between both; "
                "auto: resident if it fits, else the fastest predicted",
        choices=MOE_BACKENDS, convert=_resident_for_fused)
    moe_cache_size: int | None = flag(None, "device expert slots for offload/cpu/hybrid", metavar="N",
                                      default_text="as many as the memory allows")
    moe_cpu_threads: int | None = flag(None, "threads computing experts on the CPU", metavar="N",
                                       default_text="physical cores")
    moe_cpu_kernel: str = flag(
        "auto", "CPU expert kernel: native (compiled on first use with the host C compiler; decode), torch (oneDNN "
                "matmuls), auto: native when it builds", choices=CPU_KERNELS)
    moe_cache_policy: str = flag(
        "layer-lru", "expert slot eviction: layer-lru (LRU within per-layer shares), lru (one LRU over all layers), "
                     "layer-lrfu (decaying use counts within the shares; docs/ROUTING.md)", choices=CACHE_POLICIES)
    moe_cpu_share: int | None = flag(
        None, "hybrid: of each layer's predicted expert misses, N are computed on the CPU instead of copied",
        metavar="N", default_text="chosen by timing decode steps")
    moe_decode_table: bool = flag(
        True, "offload: decode steps read experts through a device table (hits from slots, misses over PCIe by "
              "the kernel), one CUDA graph per step; --no-moe-decode-table plans each layer on the host (DMA "
              "copies, next-layer prefetch)")
    ple_backend: str = flag(
        "auto", "where per-layer embedding tables live (Qwen3.8-Flash-Next): gpu, host (page-locked RAM), disk "
                "(memory map of the checkpoint); auto: the device when they fit its share, else host when RAM "
                "holds them, else disk", choices=PLE_BACKENDS)
    gpu_memory_limit: float | None = flag(None, "device memory ferrylm may use, in GiB", metavar="GiB",
                                          default_text="what is free")
    memory_ratio: float = flag(
        0.9, "share of the device memory free at boot the memory plan may use; --gpu-memory-utilization (vLLM's "
             "name) sets the same ratio, of the memory free at boot rather than of the card's total",
        aliases=("--gpu-memory-utilization",), metavar="R")
    memory_reserve: float | None = flag(
        None, "GiB of device memory the plan never hands out; the larger of it and the default is the one cut",
        metavar="GiB",
        default_text="max(512 MiB, (1 - --memory-ratio) x the memory free at boot), or max(512 MiB, 5%% of "
                     "--gpu-memory-limit) under a limit")
    kv_reserve_tokens: int | None = flag(
        None, "KV pool floor in tokens; with an expert cache the experts get the rest", metavar="N",
        default_text="the model context when the experts keep a tenth of the slots, else one prefill chunk plus "
                     "256 tokens per running request; at least min(context, 512)")
    moe_cache_auto: bool = flag(
        False, "give the device memory the KV floor leaves to expert slots (offload/cpu/hybrid; the memory plan "
               "does so anyway: accepted for compatibility)")
    faults: str | None = flag(
        None, "fault injection for tests, e.g. prefill_workspace:times=1 (see ferrylm/faults.py; env FERRYLM_FAULTS "
              "adds rules)", metavar="SPEC", default_text="none", hidden=True)
    check_invariants: bool = flag(False, "check KV/scheduler invariants every step", name="--debug-invariants",
                                  hidden=True)
    kv_memory_fraction: float = 0.05
    seed: int = flag(0, "seed for unseeded sampling")
    queue_timeout: float | None = flag(
        None, "seconds a request may wait for its first step before 503 queue_timeout; 0 = off",
        default_text="off", convert=_zero_is_off)
    decode_graphs: str = flag(
        "auto", "run decode steps without CUDA graphs (without it, decode steps of up to --cuda-graph-max-batch "
                "sequences are captured in CUDA graphs on a CUDA device)", name="--enforce-eager", switch="off")
    cuda_graph_max_batch: int | None = flag(None, "largest decode batch run through CUDA graphs", metavar="N",
                                            default_text="the max running requests (the flag's or the plan's)")
    cuda_graph_max_len: int = flag(
        8192, "offloading backends: longest sequence run through the piecewise CUDA graphs; longer ones decode "
              "eagerly", metavar="TOKENS")
    attention_backend: str = flag(
        "auto", "attention kernels: triton (reads the paged KV pool in place; CUDA), torch (gathers, SDPA; the CPU "
                "path), auto: triton on CUDA", choices=ATTENTION_CHOICES)
    kv_cache_dtype: str = flag(
        "auto", "KV cache element type: auto (the model dtype), fp8 (float8 e4m3 with one scale per token and KV "
                "head: about half the bytes, so twice the tokens; fp8_e4m3 is the same)",
        choices=(*KV_CACHE_DTYPES, *_KV_CACHE_SPELLINGS), convert=_kv_cache_dtype_name)
    enable_prefix_caching: bool = flag(
        True, "automatic prefix caching: full KV pages of earlier requests are reused by requests that start with "
              "the same tokens (--no-enable-prefix-caching turns it off)")
    tensor_parallel_size: int = flag(
        1, "split the model over N ranks of this host, one engine process each (NCCL on CUDA: rank r on cuda:r; "
           "gloo on the CPU); N must divide the attention heads and the MLP / expert widths",
        aliases=("--tp-size",), metavar="N")

    def to_dict(self) -> dict:
        from dataclasses import asdict
        return asdict(self)

    def validate(self) -> "EngineConfig":
        """Raise ValueError naming the flag when a value is out of range."""
        checks = [
            (self.page_size >= 1, "--page-size must be >= 1"),
            (self.num_pages is None or self.num_pages >= 1, "--num-pages must be >= 1"),
            (self.num_tokens is None or self.num_tokens >= 1, "--num-tokens must be >= 1"),
            (self.max_running_requests is None or self.max_running_requests >= 1,
             "--max-running-requests must be >= 1"),
            (self.max_prefill_length is None or self.max_prefill_length >= 1, "--max-prefill-length must be >= 1"),
            (self.max_model_len is None or self.max_model_len >= 2, "--max-model-len must be >= 2"),
            (self.queue_timeout is None or self.queue_timeout > 0, "--queue-timeout must be > 0 seconds"),
            (self.moe_cache_size is None or self.moe_cache_size >= 0, "--moe-cache-size must be >= 0"),
            (self.moe_cpu_threads is None or self.moe_cpu_threads >= 1, "--moe-cpu-threads must be >= 1"),
            (self.moe_cpu_share is None or self.moe_cpu_share >= 0, "--moe-cpu-share must be >= 0"),
            (self.moe_cpu_share is None or self.moe_backend in ("hybrid", "auto", "all"),
             f"--moe-cpu-share applies to --moe-backend hybrid, not {self.moe_backend}"),
            (self.moe_cpu_kernel in CPU_KERNELS,
             f"--moe-cpu-kernel must be one of {', '.join(CPU_KERNELS)}, got {self.moe_cpu_kernel!r}"),
            (self.moe_cache_policy in CACHE_POLICIES,
             f"--moe-cache-policy must be one of {', '.join(CACHE_POLICIES)}, got {self.moe_cache_policy!r}"),
            (self.ple_backend in PLE_BACKENDS,
             f"--ple-backend must be one of {', '.join(PLE_BACKENDS)}, got {self.ple_backend!r}"),
            (self.gpu_memory_limit is None or self.gpu_memory_limit > 0, "--gpu-memory-limit must be > 0 GiB"),
            (0 < self.memory_ratio <= 1,
             f"--memory-ratio / --gpu-memory-utilization must be in (0, 1], got {self.memory_ratio}"),
            (self.memory_reserve is None or self.memory_reserve >= 0, "--memory-reserve must be >= 0 GiB"),
            (self.kv_reserve_tokens is None or self.kv_reserve_tokens >= 1, "--kv-reserve-tokens must be >= 1"),
            (not (self.moe_cache_auto and self.moe_cache_size is not None),
             "--moe-cache-auto and --moe-cache-size exclude each other"),
            (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
             f"--device must be auto, cpu or cuda[:N], got {self.device!r}"),
            (self.decode_graphs in DECODE_GRAPH_MODES,
             f"decode_graphs must be one of {', '.join(DECODE_GRAPH_MODES)}, got {self.decode_graphs!r}"),
            (self.cuda_graph_max_batch is None or self.cuda_graph_max_batch >= 1,
             "--cuda-graph-max-batch must be >= 1"),
            (self.cuda_graph_max_len >= 1, "--cuda-graph-max-len must be >= 1 token"),
            (self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"),
            (self.dtype in ("auto", "float32", "bfloat16", "float16"),
             f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"),
            (self.tensor_parallel_size >= 1, f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}"),
            (self.tensor_parallel_size == 1 or not self.device.startswith("cuda:"),
             f"--tensor-parallel-size {self.tensor_parallel_size} places rank r on cuda:r; use --device cuda or "
             f"auto, not {self.device!r}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
        if self.faults:
            from ferrylm.faults import parse_rules

            try:
                parse_rules(self.faults)
            except ValueError as e:
                raise ValueError(f"--faults: {e}") from None
        return self

    def check_model(self, model: "ModelConfig") -> "EngineConfig":
        """Raise ValueError naming ``--max-model-len`` when it exceeds the model's own context
        (``max_position_embeddings``: positions past it were never trained, and RoPE tables and rope scaling are
        sized by it; vLLM refuses the same), and naming ``--tensor-parallel-size`` when ``model`` cannot be split
        over that many ranks.

        Rules (``models/tensor_parallel.py`` shards this way): N divides ``num_attention_heads``; N divides
        ``num_key_value_heads`` (each rank holds ``kv / N`` KV heads), or ``num_key_value_heads`` divides N (each
        KV head replicated on ``N / kv`` ranks, one KV head per rank); N divides ``intermediate_size`` (when a layer
        is dense), ``moe_intermediate_size`` and ``shared_expert_intermediate_size``. No-op for N = 1.
        """
        ctx = model.max_position_embeddings
        if self.max_model_len is not None and ctx and self.max_model_len > ctx:
            raise ValueError(f"--max-model-len {self.max_model_len} is larger than the model's context of {ctx} "
                             f"tokens (max_position_embeddings); give at most {ctx}, or leave it out")
        n = self.tensor_parallel_size
        if n == 1:
            return self
        flag = f"--tensor-parallel-size {n}"
        if model.num_heads % n:
            raise ValueError(f"{flag} must divide num_attention_heads ({model.num_heads})")
        kv = model.num_kv_heads
        if kv % n and n % kv:
            raise ValueError(f"{flag} must divide num_key_value_heads ({kv}) or be a multiple of it (KV heads "
                             f"replicated)")
        widths = [("moe_intermediate_size", model.moe_intermediate_size),
                  ("shared_expert_intermediate_size", int(model.raw.get("shared_expert_intermediate_size") or 0))]
        if not model.is_moe or model.intermediate_size:
            widths.append(("intermediate_size", model.intermediate_size))
        for name, width in widths:
            if width and width % n:
                raise ValueError(f"{flag} must divide {name} ({width})")
        return self
