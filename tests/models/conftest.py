"""Fixtures for tests/models (helpers live in hf_checkpoints.py)."""

from __future__ import annotations

import zlib

import pytest
from tests.models.hf_checkpoints import Checkpoint, build_checkpoint


def case_seed(case: str) -> int:
    """The weights' seed of ``case``: fixed by its name, so a test sees the same checkpoint whichever tests ran
    before it (it was the number of checkpoints built so far: ``pytest -k parity`` then drew other weights than
    the whole suite, and test_bfloat16_load failed alone)."""
    return zlib.crc32(case.encode()) % 10_000 + 1


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """``checkpoints(case) -> Checkpoint``, each built on first use and shared for the session."""
    cache: dict[str, Checkpoint] = {}

    def get(case: str) -> Checkpoint:
        if case not in cache:
            cache[case] = build_checkpoint(case, tmp_path_factory.mktemp(case), seed=case_seed(case))
        return cache[case]

    return get
