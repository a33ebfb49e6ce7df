"""Session-wide test settings.

All tests (and the servers they start as subprocesses) share one model cache under the checkout,
``.cache/ferrylm-test`` (git-ignored), so the built-in model is converted once per clone, not once per test
module, and the user's own cache is left alone. Set FERRYLM_CACHE_DIR to use another place.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("FERRYLM_CACHE_DIR", str(ROOT / ".cache" / "ferrylm-test"))


def _cuda_present() -> bool:
    """Without importing torch (which must not pull Triton in first): a CUDA device node exists."""
    return any(Path("/dev").glob("nvidia[0-9]*"))


# Triton kernels run in Triton's CPU interpreter on machines without a GPU (tests/kernels/interp.py). The variable is
# read when a kernel is decorated, so it is set before any test imports Triton.
if not _cuda_present():
    os.environ.setdefault("TRITON_INTERPRET", "1")
