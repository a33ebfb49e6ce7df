"""Memory readings for the plan and the OOM guard: device free/total, who else holds device memory, bytes in use,
and the peak extra memory of a warmup.

On CUDA: ``torch.cuda.mem_get_info`` (free/total as the driver sees them: other processes included),
``torch.cuda.memory_allocated`` / ``max_memory_allocated`` (this process's tensors), and nvidia-ml-py (``pynvml``,
optional) for the other processes' pids, names and bytes. On the CPU: ``psutil`` host figures (``available`` is
"free"), the process RSS for bytes in use; a peak cannot be measured there, so the workspace is estimated
(:func:`estimate_workspace`).

All sizes are bytes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger("ferrylm.memory")

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class ProcessUsage:
    """Another process holding device memory: ``pid``, process ``name``, ``used_bytes``."""

    pid: int
    name: str
    used_bytes: int

    def describe(self) -> str:
        return f"pid {self.pid} ({self.name}) {self.used_bytes / GiB:.2f} GiB"


@dataclass(frozen=True)
class MemoryReading:
    """One reading: ``kind`` ``"cuda"`` or ``"host"``, ``total_bytes``, ``free_bytes`` (what can still be
    allocated by anyone: CUDA free memory, or host ``available``)."""

    kind: str
    total_bytes: int
    free_bytes: int


def read_memory(device: torch.device) -> MemoryReading:
    """Free and total memory of ``device`` (CUDA: driver figures; CPU: host RAM, ``available`` as free)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return MemoryReading("cuda", int(total), int(free))
    import psutil

    vm = psutil.virtual_memory()
    return MemoryReading("host", int(vm.total), int(vm.available))


def free_bytes(device: torch.device) -> int:
    """Free memory of ``device`` now (bytes)."""
    return read_memory(device).free_bytes


def other_processes(device: torch.device) -> list[ProcessUsage]:
    """Other processes holding memory on CUDA ``device`` (largest first), as far as nvidia-ml-py can see them.
    Empty on the CPU, without ``pynvml``, or when NVML cannot answer. NOTE: inside a PID namespace NVML reports
    host pids, so this process may then appear in the list (with its CUDA context's bytes)."""
    if device.type != "cuda":
        return []
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver / no permission: nothing to report
        return []
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = None
        try:
            uuid = torch.cuda.get_device_properties(index).uuid
        except Exception:  # noqa: BLE001
            pass
        handle = None
        for name in ((str(uuid), f"GPU-{uuid}") if uuid is not None else ()):
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(name)
                break
            except Exception:  # noqa: BLE001 - fall back to the index (wrong under CUDA_VISIBLE_DEVICES remaps)
                handle = None
        if handle is None:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        procs = []
        for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            try:
                procs += list(getattr(pynvml, getter)(handle))
            except Exception:  # noqa: BLE001
                pass
        me = os.getpid()
        out: dict[int, ProcessUsage] = {}
        for p in procs:
            if p.pid == me or p.pid in out:
                continue
            used = int(p.usedGpuMemory or 0)
            out[p.pid] = ProcessUsage(p.pid, _process_name(p.pid), used)
        return sorted(out.values(), key=lambda u: -u.used_bytes)
    except Exception as e:  # noqa: BLE001 - diagnostics must never break the boot
        log.debug("nvml query failed: %r", e)
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def _process_name(pid: int) -> str:
    try:
        import psutil

        p = psutil.Process(pid)
        cmd = p.cmdline()
        return " ".join(cmd)[:80] if cmd else p.name()
    except Exception:  # noqa: BLE001 - another user's process, or gone
        return "?"


def mapped_file_bytes(path: str | os.PathLike, maps: str = "/proc/self/maps") -> int:
    """Bytes of this process's address space mapped from ``path`` (a file, or every file under a folder): weights
    read in place from a checkpoint (page cache, reclaimable by the OS, so not in :func:`bytes_in_use`). 0 where
    ``maps`` cannot be read (not Linux)."""
    root = os.path.realpath(path)
    total = 0
    try:
        with open(maps) as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) < 6:
                    continue
                name = parts[5].rstrip("\n")
                if name == root or name.startswith(root + os.sep):
                    lo, hi = parts[0].split("-")
                    total += int(hi, 16) - int(lo, 16)
    except OSError:
        return 0
    return total


def bytes_in_use(device: torch.device) -> int:
    """Bytes this process holds: CUDA tensors on ``device`` (allocated, not cached), or the host RSS."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    import psutil

    return int(psutil.Process().memory_info().rss)


def measure_peak(device: torch.device, fn: Callable[[], object]) -> int | None:
    """Run ``fn`` and return the peak of CUDA memory allocated above what was allocated before it (bytes).
    None on the CPU (no peak tracking; callers estimate)."""
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return max(0, int(torch.cuda.max_memory_allocated(device)) - int(base))


def allocator_slack(device: torch.device) -> int:
    """Bytes the CUDA allocator keeps reserved but not allocated after giving back what it can (fragments of
    segments that still hold live tensors): the cap counts them, tensor sizes do not. 0 on the CPU."""
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    return max(0, int(torch.cuda.memory_reserved(device)) - int(torch.cuda.memory_allocated(device)))


def release_cached(device: torch.device) -> None:
    """Give cached, unused allocator blocks back to the driver (CUDA ``empty_cache``; nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def estimate_workspace(*, hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int,
                       head_dim: int, vocab_size: int, num_experts_per_tok: int, prefill_tokens: int,
                       decode_seqs: int, dtype_bytes: int, max_model_len: int | None = None) -> int:
    """A conservative estimate (bytes) of the peak extra memory of one forward at ``prefill_tokens`` new tokens
    (one chunk, attending to itself) or a decode of ``decode_seqs`` requests, used where no peak can be measured
    (the CPU). Per token: a few ``[H]`` activations, q/k/v, the MLP (``top_k`` experts for MoE) and, per chunk,
    the ``[Hq, T, T]`` float32 attention scores of the reference attention (``T`` at most ``max_model_len``);
    plus float32 logits of every sampled row. Doubled for allocator slack."""
    t = max(prefill_tokens, decode_seqs)
    chunk = min(prefill_tokens, max_model_len or prefill_tokens)
    per_token = dtype_bytes * (6 * hidden_size + (num_heads + 2 * num_kv_heads) * head_dim
                               + 3 * intermediate_size * max(1, num_experts_per_tok))
    scores = 4 * num_heads * chunk * chunk
    logits = 4 * vocab_size * max(decode_seqs, 1) * 2
    return 2 * (t * per_token + scores + logits)
