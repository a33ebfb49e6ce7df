"""FP8 block-quantized checkpoints (``quant_method: fp8``, as DeepSeek-V3 and Qwen3-*-FP8 ship them).

Format (DeepSeek-V3's ``inference/kernel.py`` ``weight_dequant`` and transformers' FineGrainedFP8 integration):
a quantized linear has ``weight`` float8_e4m3fn ``[N, K]`` and ``weight_scale_inv`` float32 ``[ceil(N / bn),
ceil(K / bk)]`` for ``weight_block_size: [bn, bk]`` (128 x 128 in every published checkpoint); element ``(n, k)``
is ``float(weight[n, k]) * weight_scale_inv[n // bn, k // bk]``. Activation scales (``activation_scheme``) do not
change the weights and are not read (ferrylm computes with bf16 activations).

Repack: the same fp8 bytes, the block scale repeated over its ``bn`` rows (:class:`QuantFormat` ``fp8``, group
``bk``, float32 scales): lossless, and the dequantized values are the reference's bit for bit.

:func:`fp8_tensor` is the one repack of every FP8 e4m3 weight format with its scale (this reader's blocks,
compressed-tensors ``float-quantized`` tensor / channel / block, ModelOpt FP8 per tensor and per channel):

* ``tensor``: one scale for the whole weight -> group ``K``, the scale repeated over the rows (``[N, 1]``);
* ``channel``: one scale per output row (``[N]`` or ``[N, 1]``) -> group ``K``, ``[N, 1]``;
* ``block`` ``[bn, bk]``: ``[ceil(N / bn), ceil(K / bk)]`` -> group ``bk``, each block scale repeated over its rows
  (``K`` must be a multiple of ``bk``); ``group`` of ``g`` inputs: ``[N, K / g]`` -> group ``g`` (a block
  ``[1, g]``).

Scales are widened to float32 (exact); element value ``float(q) * s`` in float32, as every reference computes it.

FP4 experts (``expert_dtype: fp4`` in ``quantization_config`` or at the config's top level, DeepSeek-V4; the format
of transformers' ``FP8Experts``): an expert's ``weight`` is int8 ``[N, K / 2]``, two e2m1 codes per byte, the low
nibble first, and ``weight_scale_inv`` ``[N, K / 32]`` one scale per 32 inputs (float32, or E8M0: ``scale_fmt``
``ue8m0``, as float8_e8m0fnu or uint8 bytes). Kept as stored: ``fp4`` group 32, the bytes unchanged, E8M0 scales as
bfloat16 (exact), float32 ones as float32. The other quantized linears stay FP8 blocks.
"""

from __future__ import annotations

import torch

from ferrylm.errors import ModelLoadError
from ferrylm.experts.quantized import QuantFormat, QuantTensor
from ferrylm.checkpoints.quant.base import QuantReader, e8m0_to_bf16, expect_shape, need, same


class Fp8BlockReader(QuantReader):
    """Reads ``weight`` + ``weight_scale_inv`` modules (see the module docstring)."""

    method = "fp8"
    parts = (".weight", ".weight_scale_inv", ".input_scale", ".activation_scale")
    marker = ".weight_scale_inv"

    def __init__(self, qcfg: dict, expert_dtype: str | None = None):
        self.fp4_experts = (qcfg.get("expert_dtype") or expert_dtype or "fp8") == "fp4"
        block = qcfg.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(int(b) > 0 for b in block)):
            raise ModelLoadError(f"quantization_config quant_method fp8 without a weight_block_size [bn, bk] "
                                 f"(got {block!r}): only block-wise FP8 is supported")
        fmt = qcfg.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ModelLoadError(f"FP8 format {fmt!r} is not supported (only e4m3)")
        self.bn, self.bk = int(block[0]), int(block[1])

    def planned(self):
        if self.fp4_experts:
            return same(QuantFormat("fp4", 32, torch.bfloat16))
        return same(QuantFormat("fp8", self.bk, torch.float32))

    def _fp4(self, prefix: str, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> QuantTensor:
        """An FP4 expert weight (module docstring) as its ``fp4`` :class:`QuantTensor`."""
        w = need(parts, prefix, ".weight", (torch.int8, torch.uint8), "FP4 expert")
        s = need(parts, prefix, ".weight_scale_inv", None, "FP4 expert")
        *lead, n, half = w.shape
        expect_shape(s, (*lead, n, 2 * half // 32), prefix + ".weight_scale_inv",
                     f"its FP4 weight {list(w.shape)}, one scale per 32 inputs")
        e8m0 = getattr(torch, "float8_e8m0fnu", None)
        if s.dtype == torch.uint8 or (e8m0 is not None and s.dtype == e8m0):
            scales = e8m0_to_bf16(s.view(torch.uint8))
        elif s.dtype == torch.float32:
            scales = s
        else:
            raise ModelLoadError(f"checkpoint tensor {prefix + '.weight_scale_inv'!r} (FP4 expert) has dtype "
                                 f"{s.dtype}; expected float32 or E8M0")
        return QuantTensor(QuantFormat("fp4", 32, scales.dtype), w.view(torch.uint8).contiguous(),
                           scales.contiguous(), dtype=dtype)

    def _parts(self, prefix: str, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        w = need(parts, prefix, ".weight", (torch.float8_e4m3fn,))
        s = need(parts, prefix, ".weight_scale_inv", (torch.float32, torch.bfloat16, torch.float16))
        *lead, n, k = w.shape
        expect_shape(s, (*lead, -(-n // self.bn), -(-k // self.bk)), prefix + ".weight_scale_inv",
                     f"its weight {list(w.shape)} in {self.bn}x{self.bk} blocks")
        return w, s

    def decode(self, prefix: str, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> QuantTensor:
        if self.fp4_experts and parts.get(".weight") is not None and parts[".weight"].dtype in (torch.int8,
                                                                                              torch.uint8):
            return self._fp4(prefix, parts, dtype)
        w, s = self._parts(prefix, parts)
        return fp8_tensor(prefix, w, s, ".weight_scale_inv", "block", (self.bn, self.bk), dtype, "FP8 block")

    def dequantize(self, prefix: str, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        w, s = self._parts(prefix, parts)
        return fp8_block_dense(w, s, (self.bn, self.bk), dtype)


def fp8_block_dense(w: torch.Tensor, s: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """``float(w) * s`` of a block-scaled FP8 weight ``[..., N, K]`` (scales ``[..., ceil(N / bn), ceil(K / bk)]``,
    already checked) in ``dtype``, edge blocks cut: the plain weight of a linear outside the routed experts, whose
    ``K`` need not be a multiple of ``bk``."""
    n, k = w.shape[-2:]
    full = s.float().repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :n, :k]
    return (w.float() * full).to(dtype)


FP8_STRATEGIES = ("tensor", "channel", "block", "group")


def fp8_tensor(prefix: str, w: torch.Tensor, s: torch.Tensor, scale_suffix: str, strategy: str,
               block: tuple[int, int] | None, dtype: torch.dtype, what: str) -> QuantTensor:
    """``w`` (float8_e4m3fn ``[..., N, K]``) with its scale ``s`` (``prefix + scale_suffix``) as an ``fp8``
    :class:`QuantTensor`, for ``strategy`` in :data:`FP8_STRATEGIES` (the module docstring gives the shapes;
    ``block`` is ``(bn, bk)`` for ``block``, ``(1, g)`` for ``group``). ``what`` names the format in messages.

    Raises:
        ModelLoadError: a scale whose shape does not fit the weight for the strategy, or a block ``K`` that is not
            a multiple of ``bk`` (the message names the tensor and the format).
    """
    name = prefix + scale_suffix
    *lead, n, k = w.shape
    if strategy == "tensor":
        if s.numel() != 1:
            raise ModelLoadError(f"checkpoint tensor {name!r} ({what} per-tensor scale): {s.numel()} values "
                                 f"(shape {list(s.shape)}); expected 1")
        scales = s.float().reshape(1, 1).expand(*lead, n, 1).contiguous()
        group = k
    elif strategy == "channel":
        if tuple(s.shape) not in ((*lead, n), (*lead, n, 1)):
            expect_shape(s, (*lead, n, 1), name, f"its {what} weight {list(w.shape)}, one scale per output row")
        scales = s.float().reshape(*lead, n, 1).contiguous()
        group = k
    elif strategy in ("block", "group"):
        bn, bk = block
        expect_shape(s, (*lead, -(-n // bn), -(-k // bk)), name, f"its {what} weight {list(w.shape)} in "
                                                                 f"{bn}x{bk} blocks")
        if k % bk:
            raise ModelLoadError(f"checkpoint tensor {prefix + '.weight'!r} ({what}): K = {k} is not a multiple "
                                 f"of the block size {bk}")
        scales = s.float().repeat_interleave(bn, dim=-2)[..., :n, :].contiguous()
        group = bk
    else:
        raise ModelLoadError(f"{what}: FP8 scale strategy {strategy!r} is not supported; supported: "
                             f"{', '.join(FP8_STRATEGIES)}")
    return QuantTensor(QuantFormat("fp8", group, torch.float32), w.contiguous(), scales, dtype=dtype)
