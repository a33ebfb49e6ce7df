"""A step's attention metadata: where every sequence's tokens live in the paged KV pool (built once per step by
the model runner, ``engine/model_runner.py``), and the split-KV sizing of decode steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where a step's sequences live in the KV pool (device tensors) plus the host figures that size kernels.

    Attributes:
        slot_mapping: ``[T]`` int64 cache slot of each new token (``-1``: a padding row, nothing stored).
        block_table: ``[B, P]`` int32 pages of each sequence (row-major; columns past a sequence's pages unused).
        seq_lens: ``[B]`` int32 tokens of each sequence after this step (0: a padding sequence).
        query_start_loc: ``[B + 1]`` int32 offsets of each sequence's new tokens in the flattened batch.
        max_query_len: the most new tokens of one sequence (host int).
        num_splits: KV ranges per sequence for split-KV decode (1 = none).
        host_seqs: per sequence ``(q_len, ctx_len, page table)`` on the host, for the torch backend; None in
            captured graphs (the torch backend is not captured).
    """

    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    num_splits: int = 1
    host_seqs: list[tuple[int, int, list[int]]] | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def decode_splits(num_seqs: int, num_kv_heads: int, num_sms: int, max_splits: int = 16) -> int:
    """KV splits for a decode step of ``num_seqs`` sequences: the power of two that gives about two programs per
    multiprocessor (``num_seqs * num_kv_heads * splits ~ 2 * num_sms``), in ``[1, max_splits]``. Depends on host
    sizes only (the same for every replay of a captured batch size)."""
    want = max(1, (2 * num_sms) // max(1, num_seqs * num_kv_heads))
    splits = 1
    while splits * 2 <= min(want, max_splits):
        splits *= 2
    return splits
