"""DeepSeek-V4's compressed sparse attention in Triton (``engine/attention/triton_compress.py``,
``triton_compressed.py``, through ``TritonPagedAttention.attend_compressed``) against the torch backend's
per-sequence reference (``PagedAttention.attend_compressed``) over the same paged pool: a sliding layer, a CSA layer
(rate 4, overlapping pools, the indexer's top-k) and an HCA layer (rate 8); four sequences whose prefill chunks and
decodes cross pages (8 tokens) and compression blocks, mixed in the same steps, beside a padding sequence (a
captured batch's), with the outputs and every row the pool holds compared after each step. On CPU through Triton's
interpreter (float32, 1e-4); on a GPU also in bfloat16 and at DeepSeek-V4-Flash's attention shapes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from ferrylm.engine.attention.metadata import AttentionMetadata
from ferrylm.engine.cache.kv_pool import BlockSpec, KVLayout, KVPool
from ferrylm.models.compressed_attention import CompressedBranch, IndexerQuery
from ferrylm.models.deepseek_v4_layers import Compressor, Rope
from tests.kernels.interp import kernel_device, load_kernels

@dataclass(frozen=True)
class Shape:
    """Sizes of one case: ``rates`` CSA, HCA; ``steps``: per step, sequence -> new tokens."""

    hidden: int
    dim: int
    index_heads: int
    index_dim: int
    window: int
    page: int
    rates: tuple[int, int]
    steps: tuple[dict[str, int], ...]
    pages: int = 24


# A: chunks ending mid-page, then on a page and block boundary; B: short prompt, decodes crossing a page; C: a long
# prompt then decodes; D: a prompt joining later
TINY = Shape(24, 16, 4, 16, 5, 8, (4, 8), ({"A": 11, "B": 3, "C": 17}, {"A": 6, "B": 1, "C": 1, "D": 9},
                                           {"A": 7, "B": 1, "C": 1, "D": 7}, {"A": 1, "B": 1, "C": 1, "D": 1},
                                           {"A": 1, "B": 1, "D": 1}, {"B": 1}, {"B": 1, "C": 1}))
# DeepSeek-V4-Flash's attention shapes (D 512, indexer 64 x 128, window 128, rates 4 / 128); A ends with 662 CSA
# entries, more than the top-512
FLASH = Shape(256, 512, 64, 128, 128, 256, (4, 128), ({"A": 1024, "B": 300}, {"A": 1024, "B": 1, "C": 130},
                                                      {"A": 600, "B": 1, "C": 1}, {"A": 1, "B": 1, "C": 1},
                                                      {"A": 1, "C": 1}))


def _layers(sh: Shape) -> dict:
    """layer -> None (sliding) or (kind, rate)."""
    return {0: None, 1: ("csa", sh.rates[0]), 2: ("hca", sh.rates[1])}


def _layout(sh: Shape) -> KVLayout:
    blocks = []
    for layer, spec in _layers(sh).items():
        if spec is None:
            continue
        kind, m = spec
        blocks += [BlockSpec(layer, "compressor", m, sh.dim),
                   BlockSpec(layer, "compressor_carry", m, 4 * sh.dim, True)]
        if kind == "csa":
            blocks += [BlockSpec(layer, "indexer", m, sh.index_dim),
                       BlockSpec(layer, "indexer_carry", m, 4 * sh.index_dim, True)]
    return KVLayout(num_layers=3, layers=(0, 1, 2), k_heads=1, k_dim=sh.dim, v_heads=0, v_dim=0,
                    blocks=tuple(blocks))


def _compressor(sh: Shape, dim: int, rate: int, overlap: bool, dev, dtype, g) -> Compressor:
    rope = Rope((1.0 / (10000.0 ** (torch.arange(0, 4, 2) / 4))).to(dev))
    comp = Compressor(sh.hidden, dim, rate, overlap, 1e-6, rope)
    with torch.no_grad():
        for p in (comp.wkv.weight, comp.wgate.weight):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        comp.ape.copy_(torch.randn(comp.ape.shape, generator=g))
        comp.norm.weight.copy_(1 + 0.1 * torch.randn(dim, generator=g))
    return comp.to(dev, dtype).requires_grad_(False)


def _branch(sh: Shape, layer: int, hidden, positions, heads, g, dev, dtype, topk: int,
            ties: bool) -> CompressedBranch:
    """The layer's branch for the step's tokens (the compressors are seeded per layer: the same every step)."""
    wg = torch.Generator().manual_seed(100 + layer)
    sinks = torch.randn(heads, generator=wg).to(dev)
    branch = CompressedBranch(window=sh.window, sinks=sinks, scale=sh.dim ** -0.5)
    spec = _layers(sh)[layer]
    if spec is None:
        return branch
    kind, m = spec
    comp = _compressor(sh, sh.dim, m, kind == "csa", dev, dtype, wg)
    branch.compressor = comp
    branch.kv, branch.score = comp.inputs(hidden, positions)
    if kind == "csa":
        icomp = _compressor(sh, sh.index_dim, m, True, dev, dtype, wg)
        kv, score = icomp.inputs(hidden, positions)
        t, hi = hidden.shape[0], sh.index_heads
        weights = torch.zeros(t, hi) if ties else torch.randn(t, hi, generator=g)
        iq = torch.randn(t, hi, sh.index_dim, generator=g).to(dev, dtype)
        branch.indexer = IndexerQuery(icomp, kv, score, iq, weights.to(dev), topk)
    return branch


def _meta(plan, lens, tables, page: int, dev, pad: int) -> AttentionMetadata:
    """Metadata of a step: ``plan`` sequence -> new tokens, after ``lens`` (before the step); ``pad`` padding
    sequences after the real ones (one token each, no slot, length 0)."""
    width = max(len(tables[s]) for s in plan)
    bt, slots, seq_lens, qsl, host = [], [], [], [0], []
    for s, n in plan.items():
        start, pages = lens[s], tables[s]
        bt.append(pages + [0] * (width - len(pages)))
        slots += [pages[p // page] * page + p % page for p in range(start, start + n)]
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


def _unpadded(branch: CompressedBranch, t: int) -> CompressedBranch:
    """``branch`` for the first ``t`` rows (the torch reference has no padding sequence)."""
    real = CompressedBranch(branch.window, branch.sinks, branch.scale, branch.compressor,
                            None if branch.kv is None else branch.kv[:t],
                            None if branch.score is None else branch.score[:t])
    ix = branch.indexer
    if ix is not None:
        real.indexer = IndexerQuery(ix.compressor, ix.kv[:t], ix.score[:t], ix.q[:t], ix.weights[:t], ix.topk)
    return real


def _run(sh: Shape, heads: int, topk: int, dtype: torch.dtype, ties: bool = False,
         kv_cache_dtype: str = "auto") -> None:
    load_kernels("ferrylm.engine.attention.triton_compressed")
    from ferrylm.engine.attention.torch_backend import torch_attention
    from ferrylm.engine.attention.triton_backend import triton_attention

    dev = kernel_device()
    g = torch.Generator().manual_seed(heads * 7 + topk)
    pools = [KVPool(layout=_layout(sh), num_pages=sh.pages, page_size=sh.page, dtype=dtype, device=dev,
                    kv_cache_dtype=kv_cache_dtype) for _ in range(2)]
    free = torch.randperm(sh.pages, generator=g).tolist()
    lens = {s: 0 for s in "ABCD"}
    tables: dict[str, list[int]] = {s: [] for s in "ABCD"}
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for step, plan in enumerate(sh.steps):
        for s, n in plan.items():
            while len(tables[s]) * sh.page < lens[s] + n:
                tables[s].append(free.pop())
        ref_meta = _meta(plan, lens, tables, sh.page, dev, pad=0)
        meta = _meta(plan, lens, tables, sh.page, dev, pad=1)
        t = ref_meta.slot_mapping.shape[0]
        positions = torch.cat([torch.arange(lens[s], lens[s] + n) for s, n in plan.items()] + [torch.zeros(1)])
        positions = positions.long().to(dev)
        hidden = torch.randn(t + 1, sh.hidden, generator=g).to(dev, dtype)
        ref_backend, backend = torch_attention(pools[0], ref_meta, dev), triton_attention(pools[1], meta, dev)
        for layer in range(3):
            q = torch.randn(t + 1, heads, sh.dim, generator=g).to(dev, dtype)
            kv = torch.randn(t + 1, sh.dim, generator=g).to(dev, dtype)
            branch = _branch(sh, layer, hidden, positions, heads, g, dev, dtype, topk, ties)
            got = backend.attend_compressed(layer, q, kv, branch)
            want = ref_backend.attend_compressed(layer, q[:t], kv[:t], _unpadded(branch, t))
            err = (got[:t].float() - want.float()).abs().max().item()
            assert err <= tol, (step, layer, err)
            assert torch.equal(got[t:], torch.zeros_like(got[t:])), (step, layer)    # the padding row
        for layer in range(3):   # window rows (float8 bytes and their scales in an fp8 pool)
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
    _run(TINY, heads, topk, torch.float32)


def test_fp8_window_rows():
    """An fp8 pool: the window rows stored as float8 with one scale each, read back scaled in the kernel."""
    _run(TINY, 4, 2, torch.float32, kv_cache_dtype="fp8")


def test_equal_indexer_scores_pick_the_earlier_entries():
    """Zero indexer weights: every score is 0, and both backends keep the first ``k`` visible entries."""
    _run(TINY, 4, 2, torch.float32, ties=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bfloat16 on the GPU (not in the interpreter's tl.dot)")
def test_bfloat16_within_its_rounding():
    """bfloat16 inputs and pool, float32 accumulation: within 3e-2 of the reference. Every visible entry is kept
    (top-64): a bfloat16 rounding of a pooled indexer key may reorder two close scores, and so the picks."""
    _run(TINY, 20, 64, torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="DeepSeek-V4-Flash's shapes: too slow for the interpreter")
def test_deepseek_v4_flash_shapes():
    """64 heads of 512 dims, the indexer's 64 x 128 and top-512, window 128, rates 4 / 128, 256-token pages,
    chunks of 1024 tokens (float32)."""
    _run(FLASH, 64, 512, torch.float32)
