"""glibc malloc settings for the engine process: a step's activations are allocated and freed every step, and by
default glibc serves each allocation above its mmap threshold (128 KiB, growing after frees) with a fresh ``mmap``
and returns it to the kernel on ``free``, so every step page-faults its working set in again (on a CPU this cost a
1k-token prefill ~15 %). Kept in the heap instead, freed blocks are reused; tcmalloc and jemalloc, which vLLM's CPU
backend preloads, behave this way by default."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 1 << 30    # blocks above this are still mapped; glibc builds that cap it get their cap (below)
MMAP_THRESHOLD_CAP = 32 << 20   # HEAP_MAX_SIZE / 2 on 64-bit, the cap of the glibc builds that have one
TRIM_THRESHOLD = 1 << 30    # free heap kept before it is returned to the kernel
TOP_PAD = 64 << 20          # heap grown by this much at a time


def keep_freed_blocks() -> bool:
    """Set the engine process's glibc malloc to keep freed blocks up to :data:`MMAP_THRESHOLD` in its heap (module
    docstring). Returns False where the C library is not glibc (the settings are glibc's; nothing changes)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 or mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_CAP) == 1) \
        and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and mallopt(M_TOP_PAD, TOP_PAD) == 1
    if not ok:
        log.warning("glibc mallopt refused the engine's malloc settings; steps allocate with the defaults")
    return ok
