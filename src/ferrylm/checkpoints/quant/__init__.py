"""Quantized checkpoints: one reader per format family, each repacking into the internal representations of
:mod:`ferrylm.experts.quantized` at load (no requantization).

``quantization_config.quant_method`` (config.json) picks the reader (:func:`reader_for`); GGUF files are
served from the file by :mod:`ferrylm.checkpoints.quant.gguf_file` (config method ``gguf``: experts kept as GGML blocks,
:mod:`ferrylm.checkpoints.gguf_config`); :mod:`ferrylm.checkpoints.quant.gguf_moe` holds the lossless repack of mixed-type
projections and the older conversion into a folder of the ``ferrylm`` method. :mod:`.load` streams a
quantized checkpoint into the model; :mod:`.synthetic` makes random quantized experts for ``synthetic:`` models.

| quant_method | module | formats |
|---|---|---|
| ``fp8`` | :mod:`.fp8` | block-wise FP8 e4m3 (``weight_scale_inv``, DeepSeek-V3 / Qwen3-FP8) |
| ``compressed-tensors`` | :mod:`.compressed_tensors` | pack-quantized int4 / int8, NVFP4, MXFP4; float-quantized FP8 |
| ``modelopt`` | :mod:`.modelopt` | NVIDIA ModelOpt exports (``hf_quant_config.json``): NVFP4, FP8 |
| ``gptq`` | :mod:`.gptq` | 4-bit GPTQ (``gptq`` and ``gptq_v2`` zero points) |
| ``awq`` | :mod:`.awq` | 4-bit AWQ, AutoAWQ's GEMM packing |
| ``mxfp4`` | :mod:`.mxfp4` | gpt-oss ``*_blocks`` / ``*_scales`` expert stacks |
| ``ferrylm`` | :mod:`.native` | our own fields (GGUF conversions) |
| ``gguf`` | :mod:`.gguf_file` | a ``.gguf`` file read in place (Q4_K / Q5_K / Q6_K / Q8_0 blocks as bytes) |
"""

from __future__ import annotations

from ferrylm.errors import ModelLoadError

SUPPORTED_METHODS = ("fp8", "compressed-tensors", "modelopt", "gptq", "awq", "mxfp4", "ferrylm", "gguf")


def reader_for(config: dict):
    """The reader for ``config`` (a config.json dict), or None when it has no ``quantization_config``.

    Raises:
        ModelLoadError: a quant_method (or a variant of one) that is not supported; the message names it and
            the supported methods.
    """
    qcfg = config.get("quantization_config") or config.get("compression_config")
    if not qcfg:
        return None
    method = str(qcfg.get("quant_method", "")).lower()
    if method == "fp8":
        from ferrylm.checkpoints.quant.fp8 import Fp8BlockReader as cls
    elif method == "compressed-tensors":
        from ferrylm.checkpoints.quant.compressed_tensors import CompressedTensorsReader as cls
    elif method == "modelopt":
        from ferrylm.checkpoints.quant.modelopt import ModelOptReader as cls
    elif method == "gptq":
        from ferrylm.checkpoints.quant.gptq import GptqReader as cls
    elif method == "awq":
        from ferrylm.checkpoints.quant.awq import AwqReader as cls
    elif method == "mxfp4":
        from ferrylm.checkpoints.quant.mxfp4 import Mxfp4BlocksReader as cls
    elif method == "ferrylm":
        from ferrylm.checkpoints.quant.native import NativeReader as cls
    elif method == "gguf":  # a MoE GGUF served from its file: plans only, checkpoints/quant/gguf_file.py loads it
        from ferrylm.checkpoints.quant.gguf_file import GGUFPlanReader as cls
    else:
        raise ModelLoadError(f"quantization_config quant_method {method!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_METHODS)} (and .gguf files: Q8_0, Q4_K, Q5_K, Q6_K experts)")
    if method == "fp8":   # DeepSeek-V4 states its FP4 experts at the top level of its config
        return cls(qcfg, expert_dtype=config.get("expert_dtype"))
    return cls(qcfg)


def planned_expert_quant(config: dict):
    """The routed experts' :class:`~ferrylm.experts.quantized.ExpertQuant` a model folder's config.json promises,
    before loading (a synthetic recipe's ``quant``, or the checkpoint reader's guess); None for plain experts.

    Raises:
        ModelLoadError: an unsupported quantization method (as :func:`reader_for`).
    """
    from ferrylm.synthetic.spec import RECIPE_KEY

    recipe = config.get(RECIPE_KEY)
    if isinstance(recipe, dict):
        if not recipe.get("quant"):
            return None
        from ferrylm.synthetic.quant import SYNTHETIC_FORMATS

        return SYNTHETIC_FORMATS[recipe["quant"]]
    reader = reader_for(config)
    if reader is None:
        return None
    hidden = config.get("hidden_size")
    inter = config.get("moe_intermediate_size") or config.get("intermediate_size")
    return reader.planned_for(int(hidden), int(inter)) if hidden and inter else reader.planned()
