"""Where ferrylm keeps files it builds once per machine (the built-in MoE, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$FERRYLM_CACHE_DIR`` when set, else the XDG user cache folder ``ferrylm`` (e.g. ``~/.cache/ferrylm``)."""
    root = os.environ.get("FERRYLM_CACHE_DIR")
    if not root:
        import platformdirs

        root = platformdirs.user_cache_dir("ferrylm")
    return Path(root).expanduser()
