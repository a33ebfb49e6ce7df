"""Fixtures for tests/models (helpers live in hf_checkpoints.py)."""

from __future__ import annotations

import pytest
from tests.models.hf_checkpoints import Checkpoint, build_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """``checkpoints(case) -> Checkpoint``, each built on first use and shared for the session."""
    cache: dict[str, Checkpoint] = {}

    def get(case: str) -> Checkpoint:
        if case not in cache:
            cache[case] = build_checkpoint(case, tmp_path_factory.mktemp(case), seed=len(cache) + 1)
        return cache[case]

    return get
