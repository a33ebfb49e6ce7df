"""What every quantized-checkpoint reader provides, and helpers they share.

A quantized linear of a checkpoint is a *module*: a name prefix and several tensors (its *parts*), e.g.
``model.layers.0.mlp.experts.3.up_proj`` + ``.weight`` / ``.weight_scale_inv``. A reader knows its format's part
suffixes, which of them marks a module as quantized, and how to turn a module's parts into a
:class:`~ferrylm.experts.quantized.QuantTensor` (:meth:`QuantReader.decode`: a repack, no requantization) or a plain
weight (:meth:`QuantReader.dequantize`, for quantized linears outside the routed experts).
"""

from __future__ import annotations

import torch

from ferrylm.errors import ModelLoadError
from ferrylm.experts.quantized import ExpertQuant, QuantFormat, QuantTensor


class QuantReader:
    """Base of the format readers.

    Class attributes:
        method: the ``quantization_config.quant_method`` it reads (for messages).
        parts: every tensor-name suffix of a quantized module (separator included: ``".weight"``, ``"_blocks"``).
        marker: the suffix whose presence makes a module quantized.
    """

    method = ""
    parts: tuple[str, ...] = ()
    marker = ""

    def split(self, name: str) -> tuple[str, str] | None:
        """``(prefix, suffix)`` when ``name`` ends with one of :attr:`parts`, else None."""
        for suffix in sorted(self.parts, key=len, reverse=True):
            if name.endswith(suffix):
                return name[:-len(suffix)], suffix
        return None

    def decode(self, prefix: str, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> QuantTensor:
        """The module's weight ``[..., N, K]`` in an internal representation (``dtype``: its compute dtype).

        Raises:
            ModelLoadError: a part missing, of the wrong dtype, or of a shape that does not match the weight (the
                message names the tensor), or a variant of the format that is not supported.
        """
        raise NotImplementedError

    def dequantize(self, prefix: str, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The module's plain weight ``[N, K]`` in ``dtype`` (quantized linears outside the routed experts)."""
        return self.decode(prefix, parts, dtype).dequantize(dtype)

    def skip(self, name: str) -> bool:
        """True for a tensor of the checkpoint that is no part of what ferrylm computes and is left unread (e.g.
        ModelOpt's FP8 KV-cache scales); the module docstring of the reader says which and why."""
        return False

    def planned(self):
        """The :class:`~ferrylm.experts.quantized.ExpertQuant` the routed experts will most likely have, from the
        config alone (for sizing before the weights load; the loaded formats may differ in a scale dtype), or
        None when it cannot be told."""
        return None

    def planned_for(self, hidden: int, inter: int):
        """:meth:`planned` for experts of ``hidden`` (``H``) and ``inter`` (``I``) sizes: readers whose group follows
        ``K`` (one scale per row: gate / up group ``H``, down group ``I``) override it."""
        return self.planned()

    def gate_up_rows(self, prefix: str) -> str:
        """How a fused ``gate_up_proj`` module of this format orders its rows: ``"halves"`` (gate rows, then up
        rows: transformers' fused layout) or ``"interleaved"`` (gate, up, gate, up: gpt-oss)."""
        return "halves"


def need(parts: dict[str, torch.Tensor], prefix: str, suffix: str, dtypes: tuple[torch.dtype, ...] | None = None,
         what: str = "") -> torch.Tensor:
    """``parts[suffix]``, checked to exist and to have one of ``dtypes``. Raises ModelLoadError naming it (and the
    format ``what``, when given)."""
    fmt = f" ({what})" if what else ""
    t = parts.get(suffix)
    if t is None:
        raise ModelLoadError(f"quantized module {prefix!r}{fmt} lacks its tensor {prefix + suffix!r}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ModelLoadError(f"checkpoint tensor {prefix + suffix!r}{fmt} has dtype {t.dtype}; expected "
                             f"{' or '.join(str(d) for d in dtypes)}")
    return t


def expect_shape(t: torch.Tensor, want: tuple[int, ...], name: str, what: str) -> None:
    """Raise ModelLoadError naming ``name`` unless ``t.shape == want`` (``what`` says what it must match)."""
    if tuple(t.shape) != tuple(want):
        raise ModelLoadError(f"checkpoint tensor {name!r}: shape {list(t.shape)} does not match {what} "
                             f"(expected {list(want)})")


def nibbles(b: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., M]`` -> ``[..., 2M]`` 4-bit values, the low nibble of each byte first."""
    return torch.stack((b & 15, b >> 4), -1).flatten(-2)


def int32_bytes(t: torch.Tensor) -> torch.Tensor:
    """An int32 tensor's bytes in little-endian order (``[..., 4M]`` uint8), as the formats define them."""
    import sys

    b = t.contiguous().view(torch.uint8)
    if sys.byteorder == "big":  # pragma: no cover - no big-endian CI
        b = b.view(*t.shape, 4).flip(-1).reshape(*t.shape[:-1], -1)
    return b


def e8m0_to_bf16(e: torch.Tensor) -> torch.Tensor:
    """OCP MX E8M0 scale bytes ``e`` -> ``2^(e - 127)`` as bfloat16, exactly (``e = 0``: the subnormal 2^-127;
    ``e = 255``: NaN, OCP MX v1.0 §5.4.1)."""
    bits = e.to(torch.int16) << 7
    bits = torch.where(e == 0, torch.tensor(0x0040, dtype=torch.int16), bits)
    bits = torch.where(e == 255, torch.tensor(0x7FC0, dtype=torch.int16), bits)
    return bits.view(torch.bfloat16)


def same(fmt: QuantFormat) -> ExpertQuant:
    """One format for both projections."""
    return ExpertQuant(fmt, fmt)
