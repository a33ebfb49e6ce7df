"""The tensor-parallel process group of one engine: ``N`` rank processes of one host, joined by torch.distributed.

Backends by device: NCCL on CUDA (rank ``r`` on ``cuda:r``) for the model's all-reduces, plus a gloo group on the
host for the step broadcast (host buffers, no device sync on a follower); on the CPU one gloo group does both. The
rendezvous is a file store in the engine's private IPC dir (one file per engine generation), so no port is opened
beyond gloo's / NCCL's own loopback connections.

NOTE: the timeout of the collectives is long (``IDLE_TIMEOUT``): a follower waits in the step broadcast for as long
as rank 0 is idle. A dead peer is found otherwise, because a pending collective does not reliably fail when its peer
dies (gloo's all-reduce waits on a SIGKILLed peer until its timeout): the supervisor watches every rank's
process sentinel and kills the group when one exits, and each follower watches rank 0's pid.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ferrylm.models.tensor_parallel import TPShard

log = logging.getLogger("ferrylm.engine")

IDLE_TIMEOUT = datetime.timedelta(days=7)


class TensorParallelError(RuntimeError):
    """A collective of the group failed, or the group is in a state the step cannot go on from (a peer rank died,
    a header of an unexpected kind). Never an allocation failure: the OOM guard must not retry a step whose
    collectives other ranks may already be inside."""


def oom_inside_step(kind: str) -> TensorParallelError:
    """The error for an allocation failure (exception type name ``kind``) inside a tensor-parallel forward.

    NOTE: its text must not read as an allocator's (``memory/guard.is_oom`` matches "out of memory"): the OOM guard
    would retry the step while the followers wait inside its collectives."""
    return TensorParallelError(f"tensor parallel: an allocation failed on rank 0 ({kind}) inside the step's "
                               f"collectives; the step cannot be retried, the rank group is restarted")


@dataclass
class TPGroup:
    """One rank's membership in the group.

    Attributes:
        shard: rank and size (what part of the model this rank holds).
        device: this rank's compute device.
        device_group: the group of the model's all-reduces (NCCL on CUDA, gloo on the CPU).
        cpu_group: the gloo group of the step broadcast (``device_group`` itself on the CPU).
    """

    shard: TPShard
    device: torch.device
    device_group: object
    cpu_group: object

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` (any shape, on ``device``) over the ranks, in place; returns ``t``. Identical bits on every rank
        (one reduction order for the whole group)."""
        dist.all_reduce(t, group=self.device_group)
        return t

    def close(self) -> None:
        """Leave the group (best effort: a peer may be gone already)."""
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001
            log.debug("tensor parallel: destroy_process_group failed: %r", e)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: ``cuda:rank`` on CUDA, the CPU otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


def init_group(shard: TPShard, device: torch.device, rendezvous: str) -> TPGroup:
    """Join the group of ``shard.size`` ranks meeting at file ``rendezvous`` (created by the first rank to arrive;
    it must not hold a previous group's store). On CUDA the current device becomes ``cuda:rank``; on the CPU each
    rank takes ``1 / size`` of torch's threads unless ``OMP_NUM_THREADS`` says otherwise.

    Raises:
        ValueError: CUDA with fewer visible devices than ranks (names ``--tensor-parallel-size``).
        RuntimeError: the rendezvous or a backend failed (torch.distributed's error).
    """
    dev = rank_device(device, shard.rank)
    if dev.type == "cuda":
        count = torch.cuda.device_count()
        if shard.size > count:
            raise ValueError(f"--tensor-parallel-size {shard.size} needs {shard.size} GPUs; {count} visible")
        torch.cuda.set_device(dev)
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")   # ranks of one host meet on loopback
        if "OMP_NUM_THREADS" not in os.environ:   # the ranks share the host's cores: no oversubscription
            torch.set_num_threads(max(1, torch.get_num_threads() // shard.size))
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, init_method=f"file://{rendezvous}", rank=shard.rank,
                            world_size=shard.size, timeout=IDLE_TIMEOUT)
    world = dist.group.WORLD
    cpu = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT) if backend != "gloo" else world
    log.info("tensor parallel: rank %d of %d joined (%s on %s)", shard.rank, shard.size, backend, dev)
    return TPGroup(shard=shard, device=dev, device_group=world, cpu_group=cpu)
