"""Another program on the GPU: ``python -m ferrylm.bench.gpu_hold --leave-gib N`` takes all but N GiB of device 0's
free memory with plain allocations, prints ``held <bytes>`` and holds it until killed (``ferry bench suite``'s
shared-GPU scenarios start one before ``ferry serve``)."""

from __future__ import annotations

import argparse
import signal
import sys
import time


def hold(leave_bytes: int, chunk_bytes: int = 1 << 30) -> list:
    """Allocate free memory minus ``leave_bytes`` in chunks of ``chunk_bytes``; return the tensors."""
    import torch

    free, _ = torch.cuda.mem_get_info()
    want = max(0, free - leave_bytes)
    blocks = []
    while want > 0:
        n = min(chunk_bytes, want)
        blocks.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
        want -= n
    torch.cuda.synchronize()
    return blocks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ferrylm.bench.gpu_hold")
    p.add_argument("--leave-gib", type=float, required=True, help="GiB of free device memory left to others")
    a = p.parse_args(argv)
    blocks = hold(int(a.leave_gib * 2**30))
    print(f"held {sum(b.numel() for b in blocks)}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
