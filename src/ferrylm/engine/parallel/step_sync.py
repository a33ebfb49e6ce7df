"""Rank 0 tells the followers what to compute: one header and the packed step inputs per step, broadcast over the
group's host (gloo) group before rank 0 runs the step.

Wire format (no pickle, no msgpack: every field is an integer):

1. the header, ``HEADER_FIELDS`` int64 (:class:`StepHeader`), one broadcast of a fixed size;
2. for a ``STEP``: the packed inputs of ``engine/step_inputs.py`` (``PackLayout(tokens, seqs, pages, samples).size``
   int64: token ids, positions, slots, sequence lengths, query starts, block table, routing keys, sample rows),
   broadcast from rank 0's page-locked staging buffer into the follower's.

Kinds: ``STEP`` (run this forward), ``SHUTDOWN`` (the engine stops: exit 0), ``ABANDON`` (rank 0 gives up, e.g. its
boot failed: exit 1). Each header names the KV pool the step runs on (``runner``: a counter of rank 0's model runners,
``num_pages`` x ``page_size``): a follower allocates a pool of the same pages when the runner changes (the boot
warmup runs on a throwaway pool, the engine on the planned one), so the page tables of rank 0's scheduler address
the same pages on every rank. ``expert_budget``: the bytes rank 0 reserved for expert slots (-1: none), reserved
likewise by a follower's offloading executor.
"""

from __future__ import annotations

import logging
from dataclasses import astuple, dataclass

import numpy as np
import torch
import torch.distributed as dist

from ferrylm.engine.parallel.group import TensorParallelError, TPGroup
from ferrylm.engine.step_inputs import HostStep, PackLayout

log = logging.getLogger("ferrylm.engine")

STEP, SHUTDOWN, ABANDON = 1, 2, 3
KIND_NAMES = {STEP: "step", SHUTDOWN: "shutdown", ABANDON: "abandon"}


@dataclass(frozen=True)
class StepHeader:
    """What a follower needs besides the packed inputs. ``tokens``/``seqs``/``pages``/``samples``: the
    :class:`PackLayout`; ``num_tokens``/``num_seqs``: the real ones (padding follows); ``max_query_len``: the most
    new tokens of one sequence."""

    kind: int
    runner: int = 0
    num_pages: int = 0
    page_size: int = 0
    tokens: int = 0
    seqs: int = 0
    pages: int = 0
    samples: int = 0
    num_tokens: int = 0
    num_seqs: int = 0
    max_query_len: int = 0
    expert_budget: int = -1

    @property
    def layout(self) -> PackLayout:
        return PackLayout(tokens=self.tokens, seqs=self.seqs, pages=self.pages, samples=self.samples)

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor(astuple(self), dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "StepHeader":
        """Raises TensorParallelError for a kind this code does not know (a mismatched peer)."""
        h = cls(*(int(v) for v in t.tolist()))
        if h.kind not in KIND_NAMES:
            raise TensorParallelError(f"tensor parallel: a step header of unknown kind {h.kind}")
        return h


HEADER_FIELDS = len(astuple(StepHeader(STEP)))


class StepBroadcaster:
    """Rank 0's side. ``runner_id()`` numbers each model runner (a KV pool); :meth:`send_step` broadcasts a step.

    ``in_step`` is True from a step's broadcast until its forward returned (:meth:`step_done`): while it is, the
    followers may be inside the step's collectives, so no other header may be sent (a failure then ends the group).
    """

    def __init__(self, group: TPGroup):
        self.group = group
        self._runners = 0
        self.expert_budget = -1
        self.in_step = False

    def runner_id(self) -> int:
        self._runners += 1
        return self._runners

    def send_step(self, runner: int, num_pages: int, page_size: int, host: HostStep, buffer: torch.Tensor) -> None:
        """Broadcast ``host`` (packed into the CPU tensor ``buffer``'s first ``host.layout.size`` elements).

        Raises:
            TensorParallelError: a follower is gone (the collective failed).
        """
        lay = host.layout
        header = StepHeader(STEP, runner, num_pages, page_size, lay.tokens, lay.seqs, lay.pages, lay.samples,
                            host.num_tokens, host.num_seqs, host.max_query_len, self.expert_budget)
        self.in_step = True
        try:
            dist.broadcast(header.to_tensor(), src=0, group=self.group.cpu_group)
            dist.broadcast(buffer[:lay.size], src=0, group=self.group.cpu_group)
        except Exception as e:  # noqa: BLE001 - gloo's errors are RuntimeErrors of many texts
            raise TensorParallelError(f"tensor parallel: the step broadcast failed ({type(e).__name__}: "
                                      f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None

    def step_done(self) -> None:
        self.in_step = False

    def send_final(self, kind: int) -> bool:
        """Send ``SHUTDOWN`` or ``ABANDON``; returns whether it went out (never while a step may be inside its
        collectives, never raises: the followers' watch of rank 0 and the supervisor end them otherwise)."""
        if self.in_step:
            return False
        try:
            dist.broadcast(StepHeader(kind).to_tensor(), src=0, group=self.group.cpu_group)
            return True
        except Exception as e:  # noqa: BLE001
            log.warning("tensor parallel: could not send %s to the followers: %r", KIND_NAMES[kind], e)
            return False


class StepReceiver:
    """A follower's side: :meth:`recv` blocks until rank 0's next header (and its packed step)."""

    def __init__(self, group: TPGroup):
        self.group = group
        self._header = torch.empty(HEADER_FIELDS, dtype=torch.int64)
        self._buf = torch.empty(1 << 14, dtype=torch.int64, pin_memory=group.device.type == "cuda")

    def recv(self) -> tuple[StepHeader, torch.Tensor | None]:
        """``(header, packed [layout.size] int64 CPU tensor or None)``; the tensor is reused by the next call.

        Raises:
            TensorParallelError: rank 0 is gone or sent an unknown kind.
        """
        try:
            dist.broadcast(self._header, src=0, group=self.group.cpu_group)
            header = StepHeader.from_tensor(self._header)
            if header.kind != STEP:
                return header, None
            n = header.layout.size
            if self._buf.numel() < n:
                self._buf = torch.empty(max(n, 2 * self._buf.numel()), dtype=torch.int64,
                                        pin_memory=self.group.device.type == "cuda")
            packed = self._buf[:n]
            dist.broadcast(packed, src=0, group=self.group.cpu_group)
            return header, packed
        except TensorParallelError:
            raise
        except Exception as e:  # noqa: BLE001
            raise TensorParallelError(f"tensor parallel: lost rank 0 ({type(e).__name__}: "
                                      f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None


def host_step(header: StepHeader, packed: torch.Tensor) -> HostStep:
    """The :class:`HostStep` rank 0 packed, rebuilt from the broadcast: per real sequence ``(q_len, ctx_len, its
    pages)`` from the query starts, lengths and block table (one Python loop over the ``B`` sequences, as rank 0's
    packing)."""
    lay = header.layout
    arr = packed.numpy()
    v = {k: t.numpy() for k, t in lay.views(packed).items()}
    b, ps = header.num_seqs, max(1, header.page_size)
    qsl, lens, bt = v["query_start_loc"], v["seq_lens"], v["block_table"]
    q_lens = np.diff(qsl[:b + 1])
    host_seqs = []
    for i in range(b):
        end = int(lens[i])
        host_seqs.append((int(q_lens[i]), end - int(q_lens[i]), bt[i, :-(-end // ps)].tolist()))
    return HostStep(packed=arr, layout=lay, num_tokens=header.num_tokens, num_seqs=b,
                    max_query_len=header.max_query_len, sample_rows=v["sample_rows"].tolist(), host_seqs=host_seqs)
