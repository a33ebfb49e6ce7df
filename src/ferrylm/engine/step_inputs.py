"""A step's inputs on the host, packed for ONE non-blocking host->device copy.

From the scheduler's batch (each sequence: its request, the first new position ``start``, ``num_tokens`` new tokens,
its page table) the runner needs, for the flattened batch of ``T`` new tokens and ``B`` sequences: token ids and
positions ``[T]``, the cache slot of each new token ``[T]``, each sequence's length after the step ``[B]``, the query
start offsets ``[B + 1]`` and the block table ``[B, P]``. They are written into one int64 array (numpy, vectorised
over tokens: the only Python loop is over the ``B`` sequences, to read their token ids and page tables) that lives
in page-locked memory, and sent with one ``copy_(non_blocking=True)``; the device tensors are views of one buffer.

Padding (for CUDA graphs captured at a batch size ``B_pad >= B``): padding sequences get one query row each, token 0
at position 0, slot ``-1`` (the KV store skips it) and length 0 (attention writes zeros for it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PackLayout:
    """Offsets (int64 elements) of the fields in a packed step: ``T`` token rows, ``B`` sequences, ``P`` block-table
    columns, ``S`` sampling sequences."""

    tokens: int
    seqs: int
    pages: int
    samples: int = 0

    @property
    def size(self) -> int:
        return 4 * self.tokens + self.seqs + (self.seqs + 1) + self.seqs * self.pages + self.samples

    def views(self, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        """``packed [size]`` -> named views: ``input_ids``, ``positions``, ``slot_mapping`` ``[T]``, ``seq_lens``
        ``[B]``, ``query_start_loc`` ``[B + 1]``, ``block_table`` ``[B, P]``, ``routing_keys`` ``[T]`` (each token's
        sequence key, read by a synthetic model's routing model; 0 for padding), ``sample_rows`` ``[S]`` (the
        flattened row of each sampling sequence's last token)."""
        t, b, p = self.tokens, self.seqs, self.pages
        o = [0, t, 2 * t, 3 * t, 3 * t + b, 3 * t + 2 * b + 1, 3 * t + 2 * b + 1 + b * p]
        keys = o[6] + t  # the routing keys before the sample rows: a graph's static offsets depend on T, B, P only
        return {"input_ids": packed[o[0]:o[1]], "positions": packed[o[1]:o[2]], "slot_mapping": packed[o[2]:o[3]],
                "seq_lens": packed[o[3]:o[4]], "query_start_loc": packed[o[4]:o[5]],
                "block_table": packed[o[5]:o[6]].view(b, p), "routing_keys": packed[o[6]:keys],
                "sample_rows": packed[keys:keys + self.samples]}


@dataclass
class HostStep:
    """One step's packed inputs on the host and the figures the runner needs without reading the device.

    Attributes:
        packed: ``[layout.size]`` int64 (numpy view of page-locked memory when CUDA is used).
        layout: field offsets.
        num_tokens: ``T`` real tokens; num_seqs: ``B`` real sequences (padding follows them).
        max_query_len: most new tokens of one sequence. sample_rows: flattened row of each sampling sequence's
            last token. host_seqs: per real sequence ``(q_len, ctx_len, page table)`` (torch attention backend).
    """

    packed: np.ndarray
    layout: PackLayout
    num_tokens: int
    num_seqs: int
    max_query_len: int
    sample_rows: list[int]
    host_seqs: list[tuple[int, int, list[int]]]


def pack_step(seqs, page_size: int, out: np.ndarray | None = None, *, pad_seqs: int = 0,
              pages: int | None = None) -> HostStep:
    """Pack a batch (module docstring).

    Args:
        seqs: the scheduler's ``ScheduledSeq`` list (``request``, ``start``, ``num_tokens``, ``sample``).
        page_size: tokens per KV page.
        out: an int64 array of at least the packed size to write into (a page-locked staging buffer), else one is
            allocated.
        pad_seqs: padding sequences after the real ones (one token each; see the module docstring).
        pages: block-table columns (a captured graph's fixed width); default the longest page table.

    Raises:
        ValueError: a page table longer than ``pages``, or ``out`` too small.
    """
    b = len(seqs)
    q_lens = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=b)
    starts = np.fromiter((s.start for s in seqs), dtype=np.int64, count=b)
    tables = [s.request.page_table for s in seqs]
    width = max((len(t) for t in tables), default=1) if pages is None else pages
    if pages is not None and any(len(t) > pages for t in tables):
        raise ValueError(f"a page table is longer than the {pages} columns of this step's block table")
    t_real = int(q_lens.sum())
    sampling = [i for i, s in enumerate(seqs) if s.sample]
    layout = PackLayout(tokens=t_real + pad_seqs, seqs=b + pad_seqs, pages=max(1, width), samples=len(sampling))
    if out is None:
        out = np.empty(layout.size, dtype=np.int64)
    elif out.shape[0] < layout.size:
        raise ValueError(f"staging buffer of {out.shape[0]} elements; the step needs {layout.size}")
    v = {k: t.numpy() for k, t in layout.views(torch.from_numpy(out[:layout.size])).items()}
    qsl = v["query_start_loc"]
    qsl[0] = 0
    np.cumsum(q_lens, out=qsl[1:b + 1])
    qsl[b + 1:] = t_real + np.arange(1, pad_seqs + 1)
    ids = v["input_ids"]
    for i, s in enumerate(seqs):  # one slice per sequence: the request's token list
        ids[qsl[i]:qsl[i + 1]] = s.request.tokens(s.start, s.start + s.num_tokens)
    ids[t_real:] = 0
    bt = v["block_table"]
    bt[:] = 0
    for i, t in enumerate(tables):
        bt[i, :len(t)] = t
    seq_of_row = np.repeat(np.arange(b), q_lens)
    pos = v["positions"]
    pos[:t_real] = starts[seq_of_row] + (np.arange(t_real) - qsl[:b][seq_of_row])
    pos[t_real:] = 0
    slots = v["slot_mapping"]
    slots[:t_real] = bt[seq_of_row, pos[:t_real] // page_size] * page_size + pos[:t_real] % page_size
    slots[t_real:] = -1
    lens = v["seq_lens"]
    lens[:b] = starts + q_lens
    lens[b:] = 0
    keys = v["routing_keys"]
    keys[:t_real] = np.fromiter((routing_key(s.request) for s in seqs), dtype=np.int64, count=b)[seq_of_row]
    keys[t_real:] = 0
    v["sample_rows"][:] = qsl[1:b + 1][sampling] - 1
    sample_rows = v["sample_rows"].tolist()
    host_seqs = [(int(q_lens[i]), int(starts[i]), tables[i]) for i in range(b)]
    return HostStep(packed=out[:layout.size], layout=layout, num_tokens=t_real, num_seqs=b,
                    max_query_len=int(q_lens.max()) if b else 0, sample_rows=sample_rows, host_seqs=host_seqs)


def routing_key(request) -> int:
    """The request's sequence key for a synthetic model's routing model (``synthetic/routing_model.sequence_key`` of its
    prompt and sampling seed), computed once per request: each request routes as an independent sequence, a
    preempted or resent one as before. Real models ignore it."""
    key = request.routing_key
    if key is None:
        from ferrylm.synthetic.routing_model import sequence_key

        key = request.routing_key = sequence_key(request.prompt_token_ids, request.params.seed or 0)
    return int(key)


def bind_routing_keys(model, keys: torch.Tensor) -> None:
    """Hand a synthetic model's routing model the step's ``keys [T]`` (each token's sequence key: requests route
    independently); a no-op for models without one. Graph runners bind their static buffer before capture."""
    ctx = getattr(model, "routing_context", None)
    if ctx is not None:
        ctx.set_keys(keys)


class Staging:
    """Two page-locked int64 staging buffers used in turn (a step's copy may still be in flight while the next
    step packs), grown when a step needs more. On the CPU, plain memory."""

    def __init__(self, device: torch.device, initial: int = 1 << 14):
        self.device = device
        self._bufs: list[torch.Tensor] = [self._alloc(initial), self._alloc(initial)]
        self._turn = 0

    def _alloc(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int64, pin_memory=self.device.type == "cuda")

    def next(self, size: int) -> np.ndarray:
        """A host buffer of at least ``size`` int64 elements (numpy view of the next page-locked buffer)."""
        self._turn ^= 1
        if self._bufs[self._turn].numel() < size:
            self._bufs[self._turn] = self._alloc(max(size, 2 * self._bufs[self._turn].numel()))
        return self._bufs[self._turn].numpy()

    def current(self) -> torch.Tensor:
        """The torch tensor of the buffer :meth:`next` handed out last (what a step was packed into)."""
        return self._bufs[self._turn]

    def to_device(self, host: HostStep, dst: torch.Tensor | None = None) -> torch.Tensor:
        """Copy ``host.packed`` (packed into :meth:`next`'s buffer) to the device, into ``dst`` when given (a static
        buffer), in one non-blocking copy from page-locked memory; returns the device tensor."""
        buf = self._bufs[self._turn]
        if buf.numpy().ctypes.data != host.packed.ctypes.data:
            raise ValueError("the step was not packed into this staging buffer (pack into Staging.next())")
        src = buf[:host.packed.shape[0]]  # the torch tensor of the page-locked allocation: an async copy
        if dst is None:
            if self.device.type == "cpu":
                return src.clone()
            return src.to(self.device, non_blocking=True)
        dst[:src.numel()].copy_(src, non_blocking=True)
        return dst
