"""ferrylm's own stored representation (``quant_method: ferrylm``): the fields of
:class:`~ferrylm.experts.quantized.QuantTensor` written as they are, per MoE layer and projection.

Written by the GGUF converter (:mod:`ferrylm.checkpoints.quant.gguf_moe`), which repacks GGUF's block formats once
into a cached model folder. Tensors: ``model.layers.L.mlp.experts.{gate_proj,up_proj,down_proj}.{qdata,qscales,
qmins,qrow_scale}`` with a leading ``[E]``; ``quantization_config = {"quant_method": "ferrylm", "gate_up": F,
"down": F}`` where ``F`` is :func:`format_to_json` of the projection's :class:`QuantFormat`.
"""

from __future__ import annotations

import torch

from ferrylm.errors import ModelLoadError
from ferrylm.experts.quantized import ExpertQuant, QuantFormat, QuantTensor
from ferrylm.checkpoints.quant.base import QuantReader, need

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float8_e4m3fn": torch.float8_e4m3fn}


def format_to_json(fmt: QuantFormat) -> dict:
    return {"kind": fmt.kind, "group": fmt.group, "scale_dtype": str(fmt.scale_dtype).removeprefix("torch."),
            "mins": fmt.mins, "row_scale": fmt.row_scale}


def format_from_json(d: dict, what: str) -> QuantFormat:
    try:
        return QuantFormat(d["kind"], int(d["group"]), _DTYPES[d["scale_dtype"]], bool(d.get("mins")),
                           bool(d.get("row_scale")))
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"quantization_config {what}: not a ferrylm format ({e!r})") from None


class NativeReader(QuantReader):
    """See the module docstring."""

    method = "ferrylm"
    parts = (".qdata", ".qscales", ".qmins", ".qrow_scale")
    marker = ".qdata"

    def __init__(self, qcfg: dict):
        self.gate_up = format_from_json(qcfg.get("gate_up") or {}, "gate_up")
        self.down = format_from_json(qcfg.get("down") or {}, "down")

    def planned(self):
        return ExpertQuant(self.gate_up, self.down)

    def decode(self, prefix: str, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> QuantTensor:
        fmt = self.down if prefix.endswith("down_proj") else self.gate_up
        data = need(parts, prefix, ".qdata", (fmt.data_dtype,))
        scales = need(parts, prefix, ".qscales", (fmt.scale_dtype,))
        mins = need(parts, prefix, ".qmins", (fmt.scale_dtype,)) if fmt.mins else None
        row = need(parts, prefix, ".qrow_scale", (torch.float32,)) if fmt.row_scale else None
        try:
            return QuantTensor(fmt, data, scales, mins, row, dtype)
        except ValueError as e:
            raise ModelLoadError(f"quantized module {prefix!r}: {e}") from None
