"""The offloading backends on CUDA: pinned host banks, copy stream + events, prefetch and prefill streaming give the
resident backend's tokens and logits (float32); copy timings are recorded. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from tests.experts.helpers import options
from tests.models.hf_checkpoints import build_checkpoint, token_ids

from ferrylm.models.reference_attention import SequenceCacheAttention
from ferrylm.checkpoints.loader import load_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _trace(model, prompt, n):
    kv, out, logits_all = SequenceCacheAttention(), [], []
    with torch.inference_mode():
        h = model(torch.tensor(prompt, device="cuda"), torch.arange(len(prompt), device="cuda"), kv)
        logits = model.compute_logits(h[-1:])[0]
        for i in range(n):
            tok = int(torch.argmax(logits))
            out.append(tok)
            logits_all.append(logits)
            pos = len(prompt) + i
            h = model(torch.tensor([tok], device="cuda"), torch.tensor([pos], device="cuda"), kv)
            logits = model.compute_logits(h)[0]
    return out, logits_all


@pytest.mark.parametrize("backend", ["offload", "cpu", "hybrid"])
def test_cuda_backends_equal_resident(tmp_path, backend):
    ckpt = build_checkpoint("mixtral", tmp_path / "m", seed=3)
    prompt = token_ids(12, ckpt.vocab_size, seed=4).tolist()
    ref_tok, ref_logits = _trace(load_model(ckpt.path, device="cuda").model, prompt, 8)
    for size in (1, 3):
        loaded = load_model(ckpt.path, device="cuda", moe_backend=options(backend, size))
        ex = loaded.executor
        assert ex.banks.pinned and ex.cache is None and not ex.slots.blocks  # slots are reserved on first use
        tok, logits = _trace(loaded.model, prompt, 8)
        assert tok == ref_tok
        assert max((a - b).abs().max().item() for a, b in zip(logits, ref_logits)) <= 1e-4
        ex.sync_stats()
        st = ex.stats().as_dict()
        assert all(b.device.type == "cuda" for b in ex.slots.blocks.values()) and ex.slots.blocks
        assert st["hits"] + st["misses"] == st["needed"]
        if backend != "cpu":
            assert st["copy_time_s"] > 0 and st["bytes_copied"] > 0
        ex.close()
