"""Fixtures for tests/experts: tiny random checkpoints (built once per session) and their resident references; the
native CPU kernel build."""

from __future__ import annotations

import pytest
from tests.models.conftest import case_seed
from tests.models.hf_checkpoints import Checkpoint, build_checkpoint

from ferrylm.experts.cpu_kernel import KernelBuildError, NativeExpertKernel


@pytest.fixture(scope="session")
def expert_checkpoints(tmp_path_factory):
    """``expert_checkpoints(case) -> Checkpoint``, each built on first use and shared for the session."""
    cache: dict[str, Checkpoint] = {}

    def get(case: str) -> Checkpoint:
        if case not in cache:
            cache[case] = build_checkpoint(case, tmp_path_factory.mktemp(case), seed=case_seed(case) + 10)
        return cache[case]

    return get


@pytest.fixture(scope="session")
def kernel(tmp_path_factory):
    """The native CPU kernels, built once for the session; the test skips on a machine without a C compiler (the
    torch path is covered elsewhere)."""
    try:
        return NativeExpertKernel.build(tmp_path_factory.mktemp("kernels"))
    except KernelBuildError as e:
        pytest.skip(f"no native kernel here: {e}")
