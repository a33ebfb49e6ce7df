"""Session-wide test settings.

All tests (and the servers they start as subprocesses) share one model cache under the checkout,
``.cache/ferrylm-test`` (git-ignored), so the built-in model is converted once per clone, not once per test
module, and the user's own cache is left alone. Set FERRYLM_CACHE_DIR to use another place.

Order: tests pass alone and in any order (``--random-order``, pytest-random-order, in the dev extra); the global
random generators are reseeded before each test, and every fixture seeds what it draws by name, never by how many
were built before.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("FERRYLM_CACHE_DIR", str(ROOT / ".cache" / "ferrylm-test"))


@pytest.fixture(autouse=True)
def _seed_global_rngs():
    """Every test starts from the same global random state, whichever tests ran before it (tests must pass alone
    and in any order: ``make test PYTEST_ARGS=--random-order``). torch is seeded only when something already
    imported it (the frontend tests never import torch)."""
    random.seed(0)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(0)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(0)


def _cuda_present() -> bool:
    """Without importing torch (which must not pull Triton in first): a CUDA device node exists."""
    return any(Path("/dev").glob("nvidia[0-9]*"))


# Triton kernels run in Triton's CPU interpreter on machines without a GPU (tests/kernels/interp.py). The variable is
# read when a kernel is decorated, so it is set before any test imports Triton.
if not _cuda_present():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def own_cache_root(tmp_path, monkeypatch) -> Path:
    """A cache root of the test's own (``FERRYLM_CACHE_DIR``) that shares the session's compiled CPU kernels, so
    what the test writes there (a machine profile) reaches no other test and no kernel is built again."""
    shared = Path(os.environ["FERRYLM_CACHE_DIR"]) / "kernels"
    shared.mkdir(parents=True, exist_ok=True)
    root = tmp_path / "cache"
    root.mkdir()
    (root / "kernels").symlink_to(shared, target_is_directory=True)
    monkeypatch.setenv("FERRYLM_CACHE_DIR", str(root))
    return root
