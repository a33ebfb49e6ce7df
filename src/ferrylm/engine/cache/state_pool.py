"""Per-request recurrent state of the linear-attention layers (Gated DeltaNet), in a pool of fixed state slots.

A hybrid model (Qwen3-Next, Qwen3.5-MoE) keeps, per sequence and per linear layer, a constant-size state instead of
K/V per token: the last ``K - 1`` inputs of its short convolution (``conv [K-1, C]``, the model dtype) and the delta
rule's state (``rec [Hv, Dk, Dv]``, float32). A request owns one *state slot* (an index into every linear layer's
tensors) from admission to its release; the slot is admitted like KV pages (``engine/scheduler.py``: a request is
admitted only when a slot is free, and finish, abort, preemption and the OOM guard give it back through
``Scheduler._release``, the path its pages take). The pool has ``max_running_requests`` slots (the memory plan counts
``StateLayout.bytes_per_slot`` for each, ``memory/plan.py``) plus one scratch slot, :attr:`StatePool.scratch`, that
padding rows of a captured decode graph read and write.

A preempted request recomputes from token 0 (its state is gone with its slot), or, with prefix caching on, from the
last page boundary of its own whose state snapshot is still kept (``engine/cache/state_snapshots.py``). A sequence whose
step starts at token
0 reads zeros, whatever its slot held before (:class:`RecurrentStep.fresh`), so a slot is never cleared on release.

How a layer reaches its state: the per-step :class:`RecurrentStep` (slots, fresh flags, the batch layout) rides on
the attention backend object (:class:`WithRecurrentState`), which every layer is handed; linear layers read
``attn.recurrent``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PleStateLayout:
    """Per-sequence state of per-layer embeddings (Qwen4-Exp, ``models/ple.py``): the last ``conv_rows`` inputs of
    each PLE layer's dilated convolution (``[conv_rows, channels]``, the model dtype) and the sequence's last
    ``context`` token ids (int64, shared by the PLE layers: the n-grams of the next tokens reach back into them)."""

    layers: tuple[int, ...]
    conv_rows: int
    channels: int
    context: int

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return len(self.layers) * self.conv_rows * self.channels * elem + 8 * self.context


@dataclass(frozen=True)
class StateLayout:
    """What one sequence's state holds in every linear-attention layer.

    Attributes:
        layers: the decoder layers with a recurrent state (the linear-attention layers).
        conv_channels: ``C`` channels of the short convolution (``2 * Hk * Dk + Hv * Dv``).
        conv_kernel: ``K`` taps; the state keeps the last ``K - 1`` inputs.
        heads: ``Hv`` value heads; key_dim, value_dim: ``Dk``, ``Dv`` per head.
        ple: the per-layer embeddings' state (:class:`PleStateLayout`), or None.
    """

    layers: tuple[int, ...]
    conv_channels: int
    conv_kernel: int
    heads: int
    key_dim: int
    value_dim: int
    ple: PleStateLayout | None = None

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Bytes of one sequence's state over all linear layers: the conv inputs in ``dtype`` (the model's) and the
        float32 delta-rule state, plus the PLE state."""
        elem = torch.empty((), dtype=dtype).element_size()
        per_layer = (self.conv_kernel - 1) * self.conv_channels * elem + self.heads * self.key_dim * self.value_dim * 4
        return len(self.layers) * per_layer + (self.ple.bytes_per_slot(dtype) if self.ple is not None else 0)

    @staticmethod
    def of(config) -> "StateLayout | None":
        """The layout of ``config``'s architecture (its model class's ``state_layout(config)``), or None for models
        without recurrent layers."""
        from ferrylm.models.registry import MODEL_REGISTRY, get_model_class

        if config.architecture not in MODEL_REGISTRY:
            return None
        fn = getattr(get_model_class(config.architecture), "state_layout", None)
        return fn(config) if fn is not None else None


class OutOfStateSlots(Exception):
    """No state slot is free (the scheduler keeps the request waiting)."""


class StatePool:
    """The state tensors of every linear layer and the free list of their slots.

    ``conv[layer]`` ``[num_slots + 1, K - 1, C]`` (model dtype) and ``rec[layer]`` ``[num_slots + 1, Hv, Dk, Dv]``
    float32, for the layers in ``layout.layers`` (other layer numbers map to nothing); with ``layout.ple``
    ``ple_conv[layer]`` ``[num_slots + 1, rows, channels]`` and ``ple_context`` ``[num_slots + 1, context]`` int64.
    Slot ``num_slots`` is the scratch slot (never handed out).

    Memory: ``(num_slots + 1) * layout.bytes_per_slot(dtype)`` bytes.

    Raises:
        ValueError: ``num_slots < 1``.
    """

    def __init__(self, layout: StateLayout, num_slots: int, dtype: torch.dtype, device: torch.device | str):
        if num_slots < 1:
            raise ValueError(f"the state pool needs at least one slot, got {num_slots}")
        self.layout = layout
        self.num_slots = num_slots
        self.scratch = num_slots
        n = num_slots + 1
        self.conv = {i: torch.zeros(n, layout.conv_kernel - 1, layout.conv_channels, dtype=dtype, device=device)
                     for i in layout.layers}
        self.rec = {i: torch.zeros(n, layout.heads, layout.key_dim, layout.value_dim, dtype=torch.float32,
                                   device=device) for i in layout.layers}
        ple = layout.ple
        self.ple_conv = ({i: torch.zeros(n, ple.conv_rows, ple.channels, dtype=dtype, device=device)
                          for i in ple.layers} if ple is not None else {})
        self.ple_context = torch.zeros(n, ple.context if ple is not None else 0, dtype=torch.long, device=device)
        self._free = list(range(num_slots - 1, -1, -1))   # a stack: pop() hands out the lowest slot first
        self._owned: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        """Every per-slot state tensor (dim 0 = slot): what a snapshot copies."""
        return [*self.conv.values(), *self.rec.values(), *self.ple_conv.values(), self.ple_context]

    def allocate(self) -> int:
        """Take a free slot. Raises OutOfStateSlots when none is free."""
        if not self._free:
            raise OutOfStateSlots(f"all {self.num_slots} state slots are taken")
        s = self._free.pop()
        self._owned.add(s)
        return s

    def free(self, slot: int) -> None:
        """Give ``slot`` back. Raises AssertionError for a slot that is not taken (a double release)."""
        if slot not in self._owned:
            raise AssertionError(f"state slot {slot} released but not taken")
        self._owned.remove(slot)
        self._free.append(slot)

    def check(self, owners: list[int | None], running: int) -> None:
        """Assert: each running request owns exactly one slot (``owners`` lists every request that may hold one,
        the first ``running`` of them running), no slot is owned twice, owned + free = total. Raises
        AssertionError."""
        held = [s for s in owners if s is not None]
        assert all(s is not None for s in owners[:running]), "a running request holds no state slot"
        assert len(set(held)) == len(held), f"a state slot is owned twice: {sorted(held)}"
        assert set(held) == self._owned, f"state slots owned {sorted(self._owned)} != held {sorted(held)}"
        assert len(self._owned) + len(self._free) == self.num_slots, "state slots leaked"
        assert not set(self._free) & self._owned, "a state slot is both free and owned"


@dataclass
class RecurrentStep:
    """One step's view of the state pool, for the linear layers (device tensors, plus host figures for eager steps).

    Attributes:
        pool: the :class:`StatePool`.
        slots: ``[B]`` int64 state slot of each sequence (the scratch slot for padding rows of a graph).
        fresh: ``[B]`` bool, True where the sequence starts at token 0 (its state is read as zeros).
        query_start_loc: ``[B + 1]`` offsets of each sequence's tokens in the flattened batch.
        num_tokens: ``T`` (host int).
        q_lens: per sequence tokens this step (host list), or None in a captured decode step (one token each).
        conv_index: the convolution's window rows (``models/kernels/gated_delta.conv_window_index``), computed
            once per step by the first linear layer and shared by the others.
        written: set by a linear layer once it wrote a state (the engine's OOM recovery reads it: a failed step
            that wrote states cannot simply be retried).
        faults: the fault injector of the step (point ``deltanet_scratch``), or None.
    """

    pool: StatePool
    slots: torch.Tensor
    fresh: torch.Tensor
    query_start_loc: torch.Tensor
    num_tokens: int
    q_lens: list[int] | None = None
    conv_index: torch.Tensor | None = None
    written: bool = False
    faults: object | None = None

    @property
    def decode_only(self) -> bool:
        """Every sequence has one token (a decode step; always so in a captured graph)."""
        return self.q_lens is None or all(n == 1 for n in self.q_lens)

    def split(self) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:
        """For a mixed step (host ``q_lens`` known): ``(starts, decode_seqs, decode_rows)``: each sequence's first
        row (host list, ``B + 1`` entries), and the device indices of the one-token sequences and of their rows
        (None when there are none). Computed once per step (one small copy), shared by the linear layers."""
        cached = self.__dict__.get("_split")
        if cached is None:
            starts = [0]
            for n in self.q_lens:
                starts.append(starts[-1] + n)
            decodes = [i for i, n in enumerate(self.q_lens) if n == 1]
            seqs = rows = None
            if decodes:
                host = torch.tensor([decodes, [starts[i] for i in decodes]], dtype=torch.long)
                dev = host.to(self.slots.device, non_blocking=True) if self.slots.is_cuda else host
                seqs, rows = dev[0], dev[1]
            cached = self.__dict__["_split"] = (starts, seqs, rows)
        return cached


class WithRecurrentState:
    """An attention backend (``models/attention.AttentionBackend``) carrying the step's :class:`RecurrentStep` as
    ``recurrent``: full-attention layers call :meth:`attend` (indexed ones :meth:`attend_indexed`) as always, linear
    layers read ``recurrent``."""

    def __init__(self, attn, recurrent: RecurrentStep):
        self.attn = attn
        self.recurrent = recurrent

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float, *, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        return self.attn.attend(layer_idx, q, k, v, scale, window=window, sinks=sinks)

    def attend_indexed(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       index) -> torch.Tensor:
        return self.attn.attend_indexed(layer_idx, q, k, v, scale, index)


def recurrent_step(pool: StatePool, seqs, query_start_loc: torch.Tensor, device: torch.device) -> RecurrentStep:
    """The :class:`RecurrentStep` of an eager step: ``seqs`` are the scheduler's ``ScheduledSeq`` (each request holds
    a slot: ``request.state_slot``); ``query_start_loc`` the step's device offsets. One small host->device copy.

    Raises:
        RuntimeError: a sequence's request holds no state slot (a scheduler bug).
    """
    slots, fresh, q_lens = [], [], []
    for s in seqs:
        slot = s.request.state_slot
        if slot is None:
            raise RuntimeError(f"request {s.request.request_id} runs without a state slot")
        slots.append(slot)
        fresh.append(1 if s.start == 0 else 0)
        q_lens.append(s.num_tokens)
    host = torch.tensor([slots, fresh], dtype=torch.long)
    dev = host.to(device, non_blocking=True) if device.type == "cuda" else host
    return RecurrentStep(pool=pool, slots=dev[0], fresh=dev[1].bool(), query_start_loc=query_start_loc,
                         num_tokens=sum(q_lens), q_lens=q_lens)
