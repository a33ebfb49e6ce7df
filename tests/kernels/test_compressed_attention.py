"""DeepSeek-V4's compressed sparse attention in Triton (``engine/attention/triton_compress.py``,
``triton_compressed.py``, through ``TritonPagedAttention.attend_compressed``) against the torch backend's
per-sequence reference (``PagedAttention.attend_compressed``) over the same paged pool: a sliding layer, a CSA layer
(rate 4, overlapping pools, the indexer's top-k) and an HCA layer (rate 8); four sequences whose prefill chunks and
decodes cross pages (8 tokens) and compression blocks, mixed in the same steps, beside a padding sequence (a
captured batch's), with the outputs and every row the pool holds compared after each step. On CPU through Triton's
interpreter (float32, 1e-4); on a GPU also in bfloat16."""

from __future__ import annotations

import pytest
import torch

from ferrylm.engine.attention.metadata import AttentionMetadata
from ferrylm.engine.cache.kv_pool import BlockSpec, KVLayout, KVPool
from ferrylm.models.compressed_attention import CompressedBranch, IndexerQuery
from ferrylm.models.deepseek_v4_layers import Compressor, Rope
from tests.kernels.interp import kernel_device, load_kernels

PAGE = 8
HIDDEN, DIM, INDEX_HEADS, INDEX_DIM, WINDOW = 24, 16, 4, 16, 5
LAYERS = {0: None, 1: ("csa", 4), 2: ("hca", 8)}   # layer -> (kind, rate)
# per step: sequence -> new tokens (A: chunks ending mid-page, then on a page and block boundary; B: short prompt,
# decodes crossing a page; C: a long prompt then decodes; D: a prompt joining later)
STEPS = [{"A": 11, "B": 3, "C": 17}, {"A": 6, "B": 1, "C": 1, "D": 9}, {"A": 7, "B": 1, "C": 1, "D": 7},
         {"A": 1, "B": 1, "C": 1, "D": 1}, {"A": 1, "B": 1, "D": 1}, {"B": 1}, {"B": 1, "C": 1}]


def _layout() -> KVLayout:
    blocks = []
    for layer, spec in LAYERS.items():
        if spec is None:
            continue
        kind, m = spec
        blocks += [BlockSpec(layer, "compressor", m, DIM), BlockSpec(layer, "compressor_carry", m, 4 * DIM, True)]
        if kind == "csa":
            blocks += [BlockSpec(layer, "indexer", m, INDEX_DIM),
                       BlockSpec(layer, "indexer_carry", m, 4 * INDEX_DIM, True)]
    return KVLayout(num_layers=len(LAYERS), layers=tuple(LAYERS), k_heads=1, k_dim=DIM, v_heads=0, v_dim=0,
                    blocks=tuple(blocks))


def _compressor(dim: int, rate: int, overlap: bool, dev, dtype, g) -> Compressor:
    rope = Rope((1.0 / (10000.0 ** (torch.arange(0, 4, 2) / 4))).to(dev))
    comp = Compressor(HIDDEN, dim, rate, overlap, 1e-6, rope)
    with torch.no_grad():
        for p in (comp.wkv.weight, comp.wgate.weight):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        comp.ape.copy_(torch.randn(comp.ape.shape, generator=g))
        comp.norm.weight.copy_(1 + 0.1 * torch.randn(dim, generator=g))
    return comp.to(dev, dtype).requires_grad_(False)


def _branch(layer: int, hidden, positions, heads, g, dev, dtype, topk: int, ties: bool) -> CompressedBranch:
    """The layer's branch for the step's tokens (the compressors are seeded per layer: the same every step)."""
    wg = torch.Generator().manual_seed(100 + layer)
    sinks = torch.randn(heads, generator=wg).to(dev)
    branch = CompressedBranch(window=WINDOW, sinks=sinks, scale=DIM ** -0.5)
    spec = LAYERS[layer]
    if spec is None:
        return branch
    kind, m = spec
    comp = _compressor(DIM, m, kind == "csa", dev, dtype, wg)
    branch.compressor = comp
    branch.kv, branch.score = comp.inputs(hidden, positions)
    if kind == "csa":
        icomp = _compressor(INDEX_DIM, m, True, dev, dtype, wg)
        kv, score = icomp.inputs(hidden, positions)
        t = hidden.shape[0]
        weights = torch.zeros(t, INDEX_HEADS) if ties else torch.randn(t, INDEX_HEADS, generator=g)
        branch.indexer = IndexerQuery(icomp, kv, score, torch.randn(t, INDEX_HEADS, INDEX_DIM, generator=g).to(dev,
                                      dtype), weights.to(dev), topk)
    return branch


def _meta(plan, lens, tables, dev, pad: int) -> AttentionMetadata:
    """Metadata of a step: ``plan`` sequence -> new tokens, after ``lens`` (before the step); ``pad`` padding
    sequences after the real ones (one token each, no slot, length 0)."""
    width = max(len(tables[s]) for s in plan)
    bt, slots, seq_lens, qsl, host = [], [], [], [0], []
    for s, n in plan.items():
        start, pages = lens[s], tables[s]
        bt.append(pages + [0] * (width - len(pages)))
        slots += [pages[p // PAGE] * PAGE + p % PAGE for p in range(start, start + n)]
        seq_lens.append(start + n)
        qsl.append(qsl[-1] + n)
        host.append((n, start, pages))
    for _ in range(pad):
        bt.append([0] * width)
        slots.append(-1)
        seq_lens.append(0)
        qsl.append(qsl[-1] + 1)

    def tensor(x):
        return torch.tensor(x, dtype=torch.int64, device=dev)

    return AttentionMetadata(slot_mapping=tensor(slots), block_table=tensor(bt), seq_lens=tensor(seq_lens),
                             query_start_loc=tensor(qsl), max_query_len=max(plan.values()), host_seqs=host)


def _run(heads: int, topk: int, dtype: torch.dtype, ties: bool = False, kv_cache_dtype: str = "auto") -> None:
    load_kernels("ferrylm.engine.attention.triton_compressed")
    from ferrylm.engine.attention.torch_backend import torch_attention
    from ferrylm.engine.attention.triton_backend import triton_attention

    dev = kernel_device()
    g = torch.Generator().manual_seed(heads * 7 + topk)
    pools = [KVPool(layout=_layout(), num_pages=24, page_size=PAGE, dtype=dtype, device=dev,
                    kv_cache_dtype=kv_cache_dtype) for _ in range(2)]
    free = torch.randperm(24, generator=g).tolist()
    lens = {s: 0 for s in "ABCD"}
    tables: dict[str, list[int]] = {s: [] for s in "ABCD"}
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for step, plan in enumerate(STEPS):
        for s, n in plan.items():
            while len(tables[s]) * PAGE < lens[s] + n:
                tables[s].append(free.pop())
        ref_meta = _meta(plan, lens, tables, dev, pad=0)
        meta = _meta(plan, lens, tables, dev, pad=1)
        t = ref_meta.slot_mapping.shape[0]
        positions = torch.cat([torch.arange(lens[s], lens[s] + n) for s, n in plan.items()] + [torch.zeros(1)])
        positions = positions.long().to(dev)
        hidden = torch.randn(t + 1, HIDDEN, generator=g).to(dev, dtype)
        ref_backend, backend = torch_attention(pools[0], ref_meta, dev), triton_attention(pools[1], meta, dev)
        for layer in LAYERS:
            q = torch.randn(t + 1, heads, DIM, generator=g).to(dev, dtype)
            kv = torch.randn(t + 1, DIM, generator=g).to(dev, dtype)
            branch = _branch(layer, hidden, positions, heads, g, dev, dtype, topk, ties)
            got = backend.attend_compressed(layer, q, kv, branch)
            real = CompressedBranch(branch.window, branch.sinks, branch.scale, branch.compressor,
                                    None if branch.kv is None else branch.kv[:t],
                                    None if branch.score is None else branch.score[:t], None)
            if branch.indexer is not None:
                ix = branch.indexer
                real.indexer = IndexerQuery(ix.compressor, ix.kv[:t], ix.score[:t], ix.q[:t], ix.weights[:t], topk)
            want = ref_backend.attend_compressed(layer, q[:t], kv[:t], real)
            err = (got[:t].float() - want.float()).abs().max().item()
            assert err <= tol, (step, layer, err)
            assert torch.equal(got[t:], torch.zeros_like(got[t:])), (step, layer)    # the padding row
        for layer in LAYERS:   # window rows (float8 bytes and their scales in an fp8 pool)
            assert torch.equal(pools[1].k[layer].view(torch.uint8), pools[0].k[layer].view(torch.uint8)), layer
            torch.testing.assert_close(pools[1].k_scale[layer], pools[0].k_scale[layer], atol=0, rtol=0)
        for key, rows in pools[0].blocks.items():
            torch.testing.assert_close(pools[1].blocks[key].float(), rows.float(), atol=tol, rtol=tol,
                                       msg=lambda m, key=key, step=step: f"step {step} {key}: {m}")
        for s, n in plan.items():
            lens[s] += n


@pytest.mark.parametrize("heads,topk", [(4, 2), (20, 64)])
def test_steps_match_the_torch_reference(heads, topk):
    """Top-2 of up to 7 CSA entries; 20 heads (two head blocks of 16) keeping every visible entry (64)."""
    _run(heads, topk, torch.float32)


def test_fp8_window_rows():
    """An fp8 pool: the window rows stored as float8 with one scale each, read back scaled in the kernel."""
    _run(4, 2, torch.float32, kv_cache_dtype="fp8")


def test_equal_indexer_scores_pick_the_earlier_entries():
    """Zero indexer weights: every score is 0, and both backends keep the first ``k`` visible entries."""
    _run(4, 2, torch.float32, ties=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bfloat16 on the GPU (not in the interpreter's tl.dot)")
def test_bfloat16_within_its_rounding():
    """bfloat16 inputs and pool, float32 accumulation: within 3e-2 of the reference. Every visible entry is kept
    (top-64): a bfloat16 rounding of a pooled indexer key may reorder two close scores, and so the picks."""
    _run(20, 64, torch.bfloat16)
