"""The engine process's malloc settings (engine/host_malloc.py): a step's freed blocks stay in the heap, so the next
step does not page-fault them in again."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

SCRIPT = r"""
import ctypes, resource, sys
if sys.argv[1] == "tuned":
    from ferrylm.engine.host_malloc import keep_freed_blocks
    assert keep_freed_blocks()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
n = 48 << 20  # one prefill chunk's activations: above glibc's default (dynamic) mmap threshold
def step():
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    libc.free(p)
step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=60, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_freed_blocks_are_reused_without_page_faults() -> None:
    default, tuned = _faults("default"), _faults("tuned")
    assert default > 8 * (48 << 20) // 4096 // 2, default   # every step faults its 48 MiB in again
    assert tuned < default // 20, (tuned, default)


POOL_SCRIPT = r"""
import torch
from ferrylm.engine.host_malloc import keep_freed_blocks
from ferrylm.engine.cache.kv_pool import pool_zeros
assert keep_freed_blocks()
loading = torch.ones(600 << 18)   # a load's 600 MiB temporary, freed: kept in the heap for reuse
del loading
pool = pool_zeros((1 << 19, 8, 32), torch.float32, "cpu")      # 512 MiB: below the 1 GiB mmap threshold
pool[123, 4, 5] = 1.0
assert float(pool[100:200].sum()) == 1.0
addr, rss, inside = pool.data_ptr(), None, False
for line in open("/proc/self/smaps"):
    head = line.split()
    if "-" in head[0] and len(head) >= 5:   # a mapping's first line: its address range
        lo, hi = (int(x, 16) for x in head[0].split("-"))
        inside = lo <= addr < hi
    elif inside and head[0] == "Rss:":
        rss = int(head[1]) << 10
        break
print(rss)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_host_kv_pool_pages_stay_untouched_until_written() -> None:
    """A host KV pool is a mapping of its own whose zero pages come from the OS when first written (not a reused heap
    block cleared at boot and resident), under the engine's malloc settings."""
    out = subprocess.run([sys.executable, "-c", POOL_SCRIPT], capture_output=True, text=True, timeout=60, check=True)
    assert int(out.stdout.strip()) < 16 << 20, out.stdout
