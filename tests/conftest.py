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
