"""The step's packed inputs (engine/step_inputs.py): positions, cache slots, query offsets, block table, sampling rows
and padding, computed with numpy from the scheduler's batch, agree with the per-token definitions; the attention
backend choice names its flag."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ferrylm.engine.attention import resolve_backend
from ferrylm.engine.attention.metadata import decode_splits
from ferrylm.engine.step_inputs import PackLayout, Staging, pack_step
from ferrylm.synthetic.routing_model import sequence_key


@dataclass
class _Req:
    ids: list[int]
    page_table: list[int]
    num_prompt_tokens: int = 0
    routing_key: int | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.ids

    params = SimpleNamespace(seed=None)

    def tokens(self, a, b):
        return self.ids[a:b]


@dataclass
class _Seq:
    request: _Req
    start: int
    num_tokens: int
    sample: bool = True


def _batch():
    ps = 4
    a = _Req(list(range(100, 111)), [7, 2, 9])         # 11 tokens: a prefill chunk of 6 after 3 cached
    b = _Req(list(range(200, 206)), [5, 1])            # a decode step at position 5
    c = _Req(list(range(300, 303)), [4])               # a whole 3-token prompt, not sampled (a cut chunk)
    return ps, [_Seq(a, 3, 6), _Seq(b, 5, 1), _Seq(c, 0, 3, sample=False)]


def test_pack_matches_the_per_token_definition():
    ps, seqs = _batch()
    host = pack_step(seqs, ps)
    v = {k: t.numpy() for k, t in host.layout.views(torch.from_numpy(host.packed)).items()}
    ids, pos, slots = [], [], []
    for s in seqs:
        for p in range(s.start, s.start + s.num_tokens):
            ids.append(s.request.ids[p])
            pos.append(p)
            slots.append(s.request.page_table[p // ps] * ps + p % ps)
    assert v["input_ids"].tolist() == ids and v["positions"].tolist() == pos and v["slot_mapping"].tolist() == slots
    assert v["query_start_loc"].tolist() == [0, 6, 7, 10] and v["seq_lens"].tolist() == [9, 6, 3]
    assert v["block_table"].tolist() == [[7, 2, 9], [5, 1, 0], [4, 0, 0]]
    assert host.sample_rows == v["sample_rows"].tolist() == [5, 6]       # last token of each sampling sequence
    assert host.max_query_len == 6 and host.num_tokens == 10 and host.num_seqs == 3
    assert host.host_seqs == [(6, 3, [7, 2, 9]), (1, 5, [5, 1]), (3, 0, [4])]
    keys = [sequence_key(s.request.ids) for s in seqs]  # each token carries its request's routing key
    assert v["routing_keys"].tolist() == [keys[0]] * 6 + [keys[1]] + [keys[2]] * 3 and len(set(keys)) == 3


def test_padding_rows_write_nothing_and_read_nothing():
    ps, seqs = _batch()
    decode = [seqs[1]]
    host = pack_step(decode, ps, pad_seqs=3, pages=8)
    v = {k: t.numpy() for k, t in host.layout.views(torch.from_numpy(host.packed)).items()}
    assert v["slot_mapping"].tolist() == [1 * ps + 1, -1, -1, -1]        # padding stores no K/V
    assert v["seq_lens"].tolist() == [6, 0, 0, 0]                         # ... and attends to nothing
    assert v["query_start_loc"].tolist() == [0, 1, 2, 3, 4]
    assert v["block_table"].shape == (4, 8) and v["input_ids"].tolist()[1:] == [0, 0, 0]
    assert v["routing_keys"].tolist()[1:] == [0, 0, 0]                   # padding rows route with key 0
    with pytest.raises(ValueError, match="longer than"):
        pack_step(decode, ps, pages=1)


def test_staging_packs_in_place_and_copies_from_its_own_buffer():
    ps, seqs = _batch()
    st = Staging(torch.device("cpu"), initial=8)
    host = pack_step(seqs, ps, st.next(200))
    dev = st.to_device(host)
    assert np.array_equal(dev.numpy(), host.packed)
    with pytest.raises(ValueError, match="staging buffer"):
        pack_step(seqs, ps, np.empty(4, dtype=np.int64))
    with pytest.raises(ValueError, match="not packed into this staging buffer"):
        st.to_device(pack_step(seqs, ps))
    assert PackLayout(tokens=2, seqs=1, pages=3, samples=1).size == 4 * 2 + 1 + 2 + 3 + 1  # routing keys: [T]


def test_attention_backend_choice():
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "torch" and resolve_backend("torch", cpu) == "torch"
    with pytest.raises(ValueError, match="--attention-backend triton needs a CUDA device"):
        resolve_backend("triton", cpu)
    with pytest.raises(ValueError, match="--attention-backend must be one of"):
        resolve_backend("flash", cpu)
    assert decode_splits(1, 4, 132) == 16 and decode_splits(64, 4, 132) == 1
    assert all(decode_splits(b, 8, 132) & (decode_splits(b, 8, 132) - 1) == 0 for b in range(1, 70))
