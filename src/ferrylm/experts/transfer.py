"""Asynchronous expert copies: a dedicated copy stream with events (CUDA), or a copy thread with futures (CPU).

Both engines share one contract, so the cache logic above them is the same on a GPU and in CI:

* :meth:`CopyEngine.copy` enqueues ``dst.copy_(src)`` behind every earlier copy (FIFO), optionally after a
  *compute fence* (the copy must not overwrite a slot that queued compute still reads).
* :meth:`CopyEngine.fence` returns a fence that completes when every copy enqueued so far has landed.
* :meth:`CopyEngine.wait` makes the compute side wait for a fence; the time compute stalls there is *exposed*
  copy time. Copy time not exposed was *hidden* behind compute.
* :meth:`CopyEngine.compute_fence` marks "compute enqueued so far" (a CUDA event on the compute stream; None on
  the CPU, where compute is synchronous and therefore already done).

Timing (seconds): CUDA engines time copy batches and stalls with CUDA events and read them later
(:meth:`CopyEngine.harvest`), so no host sync is added; the CPU engine times with ``time.perf_counter``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class CopyEngine(ABC):
    """See the module docstring. ``copy_time_s`` / ``exposed_s``: totals measured so far (after harvest)."""

    def __init__(self) -> None:
        self.copy_time_s = 0.0
        self.exposed_s = 0.0

    @abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor, after=None) -> None:
        """Enqueue ``dst.copy_(src)`` (``after``: a compute fence to wait for first, or None)."""

    @abstractmethod
    def fence(self):
        """A fence completing when all copies enqueued so far are done."""

    @abstractmethod
    def wait(self, fence) -> None:
        """Make the compute side wait for ``fence`` (None: nothing to wait for)."""

    @abstractmethod
    def compute_fence(self):
        """A fence for the compute enqueued so far (None when compute is synchronous)."""

    def batch(self):
        """Context manager around several :meth:`copy` calls: enters the copy stream once instead of once per
        copy (a few microseconds of host time each on CUDA). Default: nothing to enter."""
        return contextlib.nullcontext()

    def harvest(self) -> None:
        """Fold finished timings into ``copy_time_s`` / ``exposed_s``."""

    def synchronize(self) -> None:
        """Block until every enqueued copy is done."""
        self.wait(self.fence())

    def close(self) -> None:
        """Release threads / streams."""


class HostCopyEngine(CopyEngine):
    """Copies on one background thread (FIFO); fences are futures. For ``--device cpu``: the "device cache" is
    host memory and a copy is a memcpy, still overlapped with compute on the calling thread."""

    def __init__(self) -> None:
        super().__init__()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ferrylm-expert-copy")
        self._lock = threading.Lock()
        self._last: Future | None = None

    def _timed_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        t0 = time.perf_counter()
        with torch.inference_mode():  # slots made inside a forward are inference tensors
            dst.copy_(src)
        dt = time.perf_counter() - t0
        with self._lock:
            self.copy_time_s += dt

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after=None) -> None:
        self._last = self._pool.submit(self._timed_copy, dst, src)

    def fence(self) -> Future | None:
        return self._last  # FIFO: the last copy done => all done (None: nothing was ever enqueued)

    def wait(self, fence) -> None:
        if fence is None or fence.done():
            if fence is not None:
                fence.result()  # re-raise a failed copy
            return
        t0 = time.perf_counter()
        fence.result()
        self.exposed_s += time.perf_counter() - t0

    def compute_fence(self):
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class CudaCopyEngine(CopyEngine):
    """Copies on a dedicated CUDA stream of ``device``; fences are CUDA events. Host sources should be pinned
    (page-locked) for the copies to be asynchronous DMA."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._batch_start: torch.cuda.Event | None = None
        self._spans: list[tuple[torch.cuda.Event, torch.cuda.Event, bool]] = []  # (start, end, is_stall)
        self._entered = False  # inside batch(): the copy stream is already current

    @staticmethod
    def _event(timing: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=timing)

    @contextlib.contextmanager
    def batch(self):
        if self._entered:
            yield
            return
        with torch.cuda.stream(self.stream):
            self._entered = True
            try:
                yield
            finally:
                self._entered = False

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after=None) -> None:
        with self.batch():
            if after is not None:
                self.stream.wait_event(after)
            if self._batch_start is None:
                self._batch_start = self._event(True)
                self._batch_start.record(self.stream)
            dst.copy_(src, non_blocking=True)

    def fence(self) -> torch.cuda.Event:
        end = self._event(True)
        end.record(self.stream)
        if self._batch_start is not None:
            self._spans.append((self._batch_start, end, False))
            self._batch_start = None
        return end

    def wait(self, fence) -> None:
        if fence is None:
            return
        cur = torch.cuda.current_stream(self.device)
        if fence.query():  # already landed: nothing exposed
            cur.wait_event(fence)
            return
        t0 = self._event(True)
        t0.record(cur)
        cur.wait_event(fence)
        t1 = self._event(True)
        t1.record(cur)
        self._spans.append((t0, t1, True))

    def compute_fence(self) -> torch.cuda.Event:
        ev = self._event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def harvest(self) -> None:
        keep = []
        for start, end, stall in self._spans:
            if end.query():
                dt = start.elapsed_time(end) / 1000.0
                if stall:
                    self.exposed_s += dt
                else:
                    self.copy_time_s += dt
            else:
                keep.append((start, end, stall))
        self._spans = keep

    def synchronize(self) -> None:
        self.stream.synchronize()


def make_copy_engine(device: torch.device) -> CopyEngine:
    """:class:`CudaCopyEngine` for a CUDA device, else :class:`HostCopyEngine`."""
    return CudaCopyEngine(device) if device.type == "cuda" else HostCopyEngine()
