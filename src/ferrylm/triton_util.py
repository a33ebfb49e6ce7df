"""Small helpers shared by the Triton kernels (``engine/attention``, ``experts/kernels``). Imports no Triton."""

from __future__ import annotations

import functools

import torch


@functools.cache
def triton_available() -> bool:
    """Triton imports (its kernels can run on a CUDA device, or in its CPU interpreter under ``TRITON_INTERPRET=1``)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(x: torch.Tensor) -> bool:
    """Run the Triton kernel for a tensor on this device: CUDA with Triton. (CPU tensors take the torch path, which is
    the reference the kernels are tested against.)"""
    return x.is_cuda and triton_available()


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` for tensors of ``dtype``: exact float32 products for float32 (Triton's default
    there is TF32, a 10-bit mantissa), the native tensor-core path for 16-bit types."""
    return "ieee" if dtype == torch.float32 else "tf32"
