"""Triton kernels on CI machines without a GPU: the root ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` before
anything imports Triton when CUDA is absent, so the kernels run in Triton's CPU interpreter (float32 arithmetic on CPU
tensors); on a GPU machine they compile and run on the device.

Triton 3.6's interpreter converts loop bounds with ``int(array)``, which numpy >= 2.4 rejects for 1-element arrays;
:func:`load_kernels` patches that one conversion.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch


def _patch_index() -> None:
    import triton.runtime.interpreter as interp

    if getattr(interp, "_ferrylm_index_patched", False):
        return
    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched
    interp._ferrylm_index_patched = True


def kernel_device() -> torch.device:
    """Where kernel tests put their tensors: the GPU when there is one, else the CPU (interpreter)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def load_kernels(module: str):
    """Import the kernel module ``module`` (dotted name). Skips the test without Triton, or on a CPU machine where the
    interpreter was not switched on before Triton was imported."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("no CUDA and TRITON_INTERPRET is not set")
        _patch_index()
    return importlib.import_module(module)
