"""Linear layers and embeddings whose weight stays a GGUF file's quantized blocks on the CPU.

A GGUF served on a CPU keeps its big matrices (lm_head, token embeddings, attention q/k/v/o, dense and shared-expert
MLPs) as the file's mapped GGML blocks (Q8_0, Q4_K, Q5_K, Q6_K): no float copy is made. :class:`QuantLinear` computes
``x @ W.T`` with the native CPU kernels that also compute the experts (``experts/cpu_kernel.py``: the activation is
quantized to 8 bits per 32 inputs, the dot products are integer, as ggml's CPU backend does);
:class:`QuantEmbedding` dequantizes only the looked-up rows, bit for bit as gguf-py does. The loader
(``checkpoints/quant/gguf_file.py``) puts them in place of ``nn.Linear`` / ``nn.Embedding`` modules with
:func:`compact_modules` before the other weights are assigned. :func:`fuse_linears` makes several projections of one
input (attention's q/k/v) one matrix multiply, over float weights or blocks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ferrylm.experts.cpu_kernel import NativeExpertKernel, load_kernel
from ferrylm.experts.native_layouts import BlockMatrix
from ferrylm.experts.options import ExpertOptions


@dataclass(frozen=True)
class DenseKernel:
    """The kernel build and the threads compact modules compute with (``--moe-cpu-kernel``, ``--moe-cpu-threads``)."""

    native: NativeExpertKernel
    threads: int


def dense_kernel(device: torch.device, options: ExpertOptions) -> DenseKernel | None:
    """What a CPU model's compact layers and decode attention compute with (``--moe-cpu-kernel``,
    ``--moe-cpu-threads``): None off the CPU or without a native kernel (``torch``, or ``auto`` without a compiler).

    Raises:
        KernelBuildError: ``--moe-cpu-kernel native`` and the kernel does not build."""
    if device.type != "cpu":
        return None
    native = load_kernel(options.cpu_kernel)
    return None if native is None else DenseKernel(native, options.cpu_threads or torch.get_num_threads())


class QuantLinear(nn.Module):
    """``y = x @ W.T (+ bias)`` with ``W [N, K]`` a :class:`BlockMatrix`; ``x [..., K]`` in any float dtype ->
    ``[..., N]`` in ``x``'s dtype.

    Attributes:
        weight: the block matrix (not a tensor: the state dict holds only ``bias``, a parameter when present).
    """

    def __init__(self, weight: BlockMatrix, kernel: DenseKernel, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = weight
        self.kernel = kernel
        self.in_features, self.out_features = weight.k, weight.n
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias, requires_grad=False))

    @classmethod
    def stacked(cls, parts: list["QuantLinear"]) -> "QuantLinear":
        """One layer computing ``parts`` side by side (outputs concatenated, e.g. q|k|v in one kernel call), over
        their blocks where they lie; biases concatenated (all or none)."""
        biases = [p.bias for p in parts]
        if any(b is None for b in biases) and any(b is not None for b in biases):
            raise ValueError("stacked layers have biases on all parts or on none")
        bias = None if biases[0] is None else torch.cat(biases)
        return cls(BlockMatrix.stacked([p.weight for p in parts]), parts[0].kernel, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] == 0:
            return x.new_zeros(*lead, self.out_features)
        y = self.kernel.native.matmul(flat, self.weight, self.kernel.threads)
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype).view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {'|'.join(self.weight.kinds)}"


class QuantEmbedding(nn.Module):
    """``ids [...]`` int64 -> rows ``[..., H]`` of a one-segment :class:`BlockMatrix` ``[V, H]``, dequantized as
    gguf-py does and cast to ``dtype``."""

    def __init__(self, weight: BlockMatrix, kernel: DenseKernel, dtype: torch.dtype):
        super().__init__()
        self.weight = weight
        self.kernel = kernel
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = weight.n, weight.k

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.kernel.native.gather(self.weight, ids)
        return rows.to(self.dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.weight.kinds[0]}"


def compact_modules(model: nn.Module, weights: dict[str, BlockMatrix], kernel: DenseKernel, dtype: torch.dtype, *,
                    embeddings: bool = True) -> set[str]:
    """Put :class:`QuantLinear` / :class:`QuantEmbedding` in place of the modules of ``model`` whose weight
    (state-dict name ``<module>.weight``) is in ``weights``, where that module is a plain ``nn.Linear`` /
    ``nn.Embedding`` (only with ``embeddings``: a tied output layer reads the table as a tensor) of the same shape.
    Returns the weight names placed; a Linear's bias stays a parameter to assign. ``dtype``: what embeddings
    return."""
    placed = set()
    for key, w in weights.items():
        name = key.removesuffix(".weight")
        try:
            old = model.get_submodule(name)
        except AttributeError:
            continue
        if type(old) is nn.Linear and (old.out_features, old.in_features) == (w.n, w.k):
            new = QuantLinear(w, kernel, old.bias)
        elif embeddings and type(old) is nn.Embedding and (old.num_embeddings, old.embedding_dim) == (w.n, w.k):
            new = QuantEmbedding(w, kernel, dtype)
        else:
            continue
        parent, _, leaf = name.rpartition(".")
        (model.get_submodule(parent) if parent else model).register_module(leaf, new)
        placed.add(key)
    return placed


def _side_by_side(projs: tuple[nn.Module, ...], x: torch.Tensor) -> torch.Tensor:
    return torch.cat([p(x) for p in projs], dim=-1)


def fuse_linears(projs: Sequence[nn.Module]) -> Callable[[torch.Tensor], torch.Tensor]:
    """One callable computing the linear layers ``projs`` of one input ``x [..., K]`` side by side, outputs
    concatenated ``[..., sum N]``: float ``nn.Linear`` weights (and biases: all or none) are concatenated into one
    matrix and each layer's weight re-pointed at its view of it (no memory added; the state dict keeps its names);
    :class:`QuantLinear` ones become one kernel call over their blocks where they lie; a mix computes each layer in
    turn. Results equal the separate layers (each output element is the same dot product). Call under
    ``torch.no_grad()``."""
    if all(isinstance(p, QuantLinear) for p in projs):
        return QuantLinear.stacked(list(projs)).forward
    if any(isinstance(p, QuantLinear) for p in projs):   # blocks and floats: side by side
        return functools.partial(_side_by_side, tuple(projs))
    w = torch.cat([p.weight for p in projs])
    b = torch.cat([p.bias for p in projs]) if projs[0].bias is not None else None
    lo = 0
    for p in projs:
        hi = lo + p.weight.shape[0]
        p.weight = nn.Parameter(w[lo:hi], requires_grad=False)
        if b is not None:
            p.bias = nn.Parameter(b[lo:hi], requires_grad=False)
        lo = hi
    return functools.partial(F.linear, weight=w, bias=b)


class FusedLinears(nn.Module):
    """A module that serves several of its linear children, all fed the same input, from one matrix multiply
    (:func:`fuse_linears`) once :meth:`fuse_projections` ran (the loader calls it after the weights are in place;
    ``checkpoints/assemble.prepare_for_inference``). Subclasses name the children in :meth:`fused_children` and
    call :meth:`projections`, which falls back to the separate layers before fusion."""

    _fused: Callable[[torch.Tensor], torch.Tensor] | None = None
    _split: list[int] = []   # the children's output widths, set with ``_fused``

    def fused_children(self) -> list[nn.Module]:
        """The linear children, in the order their outputs are concatenated."""
        raise NotImplementedError

    def fuse_projections(self) -> None:
        """Concatenate the children's weights (no memory added; the state dict keeps its names). Idempotent. Left
        unfused (each child computed in turn, as before) when there is nothing to gain or keep exact: fewer than
        two children, or not all of one kind: float weights of one dtype and device, or all GGML blocks."""
        children = self.fused_children()
        if self._fused is not None or len(children) < 2:
            return
        blocks = [isinstance(p, QuantLinear) for p in children]
        if not all(blocks) and (any(blocks) or len({(p.weight.dtype, p.weight.device) for p in children}) > 1
                                or len({p.bias is None for p in children}) > 1):
            return
        with torch.no_grad():
            self._fused = fuse_linears(children)
        self._split = [p.out_features for p in children]

    @property
    def is_fused(self) -> bool:
        """The children are served by one product."""
        return self._fused is not None

    def projections(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``x [T, K]`` -> each child's output ``[T, N_i]`` (views of one product once fused)."""
        if self._fused is None:
            return [p(x) for p in self.fused_children()]
        return list(self._fused(x).split(self._split, dim=-1))

    def _apply(self, fn, recurse=True):
        """``.to()`` / ``.cuda()`` convert each parameter on its own: fuse again afterwards."""
        fused = self._fused is not None
        self._fused = None
        out = super()._apply(fn, recurse)
        if fused:
            self.fuse_projections()
        return out
