"""Only real device faults are sticky (issue 26): is_device_error matches the error kinds (cudaError_t names and
their messages), not any text containing "CUDA error"."""

from __future__ import annotations

import pytest
import torch

from ferrylm.memory.guard import STICKY_CUDA_ERRORS, is_device_error

ACCEL = getattr(torch, "AcceleratorError", RuntimeError)


def torch_msg(code: str, text: str) -> str:
    return (f"CUDA error: {text}\nSearch for `{code}' in https://docs.nvidia.com/cuda/cuda-runtime-api/"
            f"group__CUDART__TYPES.html for more information.")


@pytest.mark.parametrize("code,text", sorted(STICKY_CUDA_ERRORS.items()))
@pytest.mark.parametrize("cls", [ACCEL, RuntimeError])
def test_sticky_kinds_are_device_errors(code: str, text: str, cls) -> None:
    assert is_device_error(cls(torch_msg(code, text)))


@pytest.mark.parametrize("msg", [
    "Triton Error [CUDA]: an illegal memory access was encountered",
    "HIP error: an illegal memory access was encountered",
    "CUDA error: device-side assert triggered",
    "CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( handle, opa, opb, m, n, k, ...)`",
])
def test_other_spellings_of_sticky_faults(msg: str) -> None:
    assert is_device_error(RuntimeError(msg))


@pytest.mark.parametrize("msg", [
    torch_msg("cudaErrorInvalidValue", "invalid argument"),
    torch_msg("cudaErrorNoKernelImageForDevice", "no kernel image is available for execution on the device"),
    torch_msg("cudaErrorStreamCaptureUnsupported", "operation not permitted when stream is capturing"),
    torch_msg("cudaErrorLaunchOutOfResources", "too many resources requested for launch"),
    torch_msg("cudaErrorMemoryAllocation", "out of memory"),
    "CUDA error: out of memory",
    "the user asked about a CUDA error in their prompt",
    "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!",
])
@pytest.mark.parametrize("cls", [ACCEL, RuntimeError])
def test_non_sticky_cuda_errors_are_not(msg: str, cls) -> None:
    assert not is_device_error(cls(msg))


def test_not_a_runtime_error() -> None:
    assert not is_device_error(ValueError(torch_msg("cudaErrorIllegalAddress", "an illegal memory access was "
                                                                              "encountered")))
