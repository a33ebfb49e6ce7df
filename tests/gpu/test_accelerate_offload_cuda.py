"""``ferry bench accelerate`` on CUDA: a tiny synthetic Qwen3-MoE dispatched by ``accelerate.dispatch_model`` with
part of it offloaded to host memory decodes the same greedy tokens as the same weights all on the GPU, and reports
the bytes it copies per step. Skipped without CUDA or accelerate."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ferrylm.synthetic.presets import PRESETS, SyntheticPreset

from ferrylm.synthetic.spec import SyntheticSpec

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs accelerate"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

TINY = {**PRESETS["qwen3-30b-a3b"].config, "hidden_size": 256, "intermediate_size": 512,
        "moe_intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": 512, "max_position_embeddings": 256, "num_hidden_layers": 6, "num_experts": 16,
        "num_experts_per_tok": 4, "bos_token_id": 1, "eos_token_id": 2}


def test_cuda_offload_equals_resident():
    from ferrylm.bench import accelerate_model as am
    from ferrylm.bench import accelerate_offload as ao

    spec = SyntheticSpec(SyntheticPreset("tiny-acc-cuda", "test", TINY), 6)
    net = am.build_empty(am.hf_config(spec), torch.bfloat16)
    layer = sum(p.numel() * 2 for p in net.model.layers[0].parameters())
    embed = net.model.embed_tokens.weight.numel() * 2
    budget = (embed + 3.5 * layer) / am.GiB
    common = dict(model=spec, device="cuda", dtype="bfloat16", batch=2, tokens=8, prompt_tokens=7,
                  progress=lambda s: None)
    try:
        ref = ao.run_accelerate_bench(gpu_memory_limit=None, **common)
        off = ao.run_accelerate_bench(gpu_memory_limit=budget + 0.5, reserve=0.5, **common)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert off.placement["gpu_layers"] == [0, 1] and off.placement["offloaded_layers"] == [2, 3, 4, 5]
    assert off.placement["offloaded_bytes"] > 4 * layer   # whole layers, with all their experts
    assert off.peak_gpu_allocated_bytes <= (budget + 0.5) * am.GiB
    assert off.token_ids == ref.token_ids
    assert all(len(t) == 9 for t in off.token_ids)
