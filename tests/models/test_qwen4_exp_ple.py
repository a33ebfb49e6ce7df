"""Qwen4-Exp's per-layer embeddings (PLE) against transformers on a tiny random checkpoint (tables of two shards
each, EOS inside prompts): float32 logits within 1e-4 and identical greedy tokens for every ``--ple-backend``
placement (gpu = the compute device, host, disk = a memory map of the checkpoint), through the engine with chunked
prefill across pages and compression blocks; the boot's placement rule sends a table too large for the plan to host or
disk instead of refusing it."""

from __future__ import annotations

import pytest
import torch
import transformers
from tests.experts.helpers import options
from tests.models.hf_checkpoints import reference_logits, token_ids
from tests.models.test_qwen3_next import _run_engine, hf_greedy

from ferrylm.checkpoints.loader import load_model
from ferrylm.checkpoints.ple_tables import MmapTable, TensorTable
from ferrylm.config import EngineConfig, ModelConfig
from ferrylm.engine.cache.state_pool import StateLayout
from ferrylm.engine.ple_choice import choose_ple_backend, resolve_ple_backend

pytestmark = pytest.mark.skipif(not hasattr(transformers, "Qwen4ExpTextConfig"),
                                reason=f"transformers {transformers.__version__} has no Qwen4-Exp (5.25+)")
TOL = 1e-4
EOS = 2


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    ids = token_ids(n, vocab, seed=seed).tolist()
    ids[n // 3] = EOS            # an EOS inside the prompt: the n-grams after it restart
    return ids


@pytest.mark.parametrize("ple", ["gpu", "host", "disk"])
def test_logits_whole_and_chunked_match_transformers(checkpoints, ple):
    ckpt = checkpoints("qwen4_exp_ple")
    model = load_model(ckpt.path, ple_backend=ple).model
    table = model.model.layers[0].ple.table
    assert isinstance(table, MmapTable if ple == "disk" else TensorTable)
    ids = torch.tensor(_prompt(37, ckpt.vocab_size, 11))
    ref = reference_logits(ckpt, ids)
    from ferrylm.models.reference_attention import DenseCausalAttention, SequenceCacheAttention

    with torch.no_grad():
        whole = model.compute_logits(model(ids, torch.arange(37), DenseCausalAttention()))
        cache, pieces = SequenceCacheAttention(), []
        for lo, hi in [(0, 1), (1, 5), (5, 22)] + [(t, t + 1) for t in range(22, 37)]:
            pieces.append(model.compute_logits(model(ids[lo:hi], torch.arange(lo, hi), cache)))
    assert (whole - ref).abs().max().item() <= TOL
    assert (torch.cat(pieces) - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("ple,moe", [("gpu", "resident"), ("host", "resident"), ("disk", "resident"),
                                     ("disk", "cpu"), ("host", "offload")])
def test_engine_tokens_match_transformers_on_every_ple_backend(checkpoints, ple, moe):
    ckpt = checkpoints("qwen4_exp_ple")
    loaded = load_model(ckpt.path, ple_backend=ple,
                        moe_backend=moe if moe == "resident" else options(moe, 2, stream_prefill=False))
    prompts = {f"r{n}": _prompt(n, ckpt.vocab_size, n) for n in (5, 14, 23)}
    out, rows, engine = _run_engine(loaded, prompts, new_tokens=6)
    refs = {rid: reference_logits(ckpt, torch.tensor(p + out[rid])) for rid, p in prompts.items()}
    assert max((row - refs[rid][pos]).abs().max().item() for rid, pos, row in rows) <= TOL
    for rid, p in prompts.items():
        assert out[rid] == hf_greedy(ckpt.reference, p, 6), f"{ple}/{moe}: {rid}"
    if moe != "resident":
        loaded.executor.close()


def test_the_state_pool_holds_the_ple_state(checkpoints):
    st = StateLayout.of(ModelConfig.from_folder(checkpoints("qwen4_exp_ple").path))
    assert st.ple is not None and st.ple.layers == (0, 2) and st.ple.context == 2
    # conv: (3 taps - 1) * 3 apart = 6 rows of 3 streams x 64; context: 2 token ids
    assert st.ple.conv_rows == 6 and st.ple.bytes_per_slot(torch.float32) == 2 * 6 * 192 * 4 + 2 * 8


def test_placement_rule_moves_a_table_too_large_for_its_memory_outward():
    gib = 2**30
    assert choose_ple_backend("auto", 1 * gib, 80 * gib, 500 * gib).backend == "gpu"
    assert choose_ple_backend("auto", 90 * gib, 80 * gib, 500 * gib).backend == "host"
    assert choose_ple_backend("auto", 90 * gib, 80 * gib, 100 * gib).backend == "disk"
    assert choose_ple_backend("gpu", 90 * gib, 80 * gib, 500 * gib).backend == "host"     # never refused
    assert choose_ple_backend("host", 90 * gib, 80 * gib, 100 * gib).backend == "disk"
    assert choose_ple_backend("disk", 1, 80 * gib, 500 * gib).backend == "disk"
    assert choose_ple_backend("auto", 1 * gib, None, 500 * gib).backend == "host"          # no GPU: host memory
    assert choose_ple_backend("auto", 1 * gib, None, 1 * gib).backend == "disk"


def test_boot_serves_a_table_larger_than_host_memory_from_disk(checkpoints, monkeypatch):
    """The host reports almost no available memory: the tables go to disk, and the model served from there gives
    transformers' tokens."""
    import psutil

    ckpt = checkpoints("qwen4_exp_ple")
    mcfg = ModelConfig.from_folder(ckpt.path)
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=1024))
    choice = resolve_ple_backend(mcfg, EngineConfig(device="cpu"), torch.device("cpu"), torch.float32)
    assert choice.backend == "disk" and choice.table_bytes == (240 + 312) * 8 * 4
    monkeypatch.undo()
    assert resolve_ple_backend(mcfg, EngineConfig(device="cpu"), torch.device("cpu"), torch.float32).backend == "host"
    loaded = load_model(ckpt.path, ple_backend=choice.backend)
    prompt = _prompt(19, ckpt.vocab_size, 5)
    out, _, _ = _run_engine(loaded, {"a": prompt}, new_tokens=5)
    assert out["a"] == hf_greedy(ckpt.reference, prompt, 5)
