"""Small helpers shared by the Triton kernels (``engine/attention``, ``experts/kernels``). Imports no Triton."""

from __future__ import annotations

import torch


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` for tensors of ``dtype``: exact float32 products for float32 (Triton's default
    there is TF32, a 10-bit mantissa), the native tensor-core path for 16-bit types."""
    return "ieee" if dtype == torch.float32 else "tf32"
