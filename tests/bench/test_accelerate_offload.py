"""``ferry bench accelerate`` (the transformers + accelerate offload baseline) on the CPU: a tiny
synthetic Qwen3-MoE, offloaded in part through accelerate's hooks, decodes the same greedy tokens as the model
without offload and as transformers' own ``generate``; the CLI prints the table and a one-line JSON; the plan for
the real Qwen3-30B-A3B shapes under a 24 GiB cap (meta device only, nothing materialized)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from ferrylm import cli
from ferrylm.synthetic.presets import PRESETS, SyntheticPreset
from ferrylm.synthetic.spec import SyntheticSpec, parse_synthetic_spec

from ferrylm.bench import accelerate_model as am
from ferrylm.bench import accelerate_offload as ao

# accelerate comes with the dev extra (and the bench extra); only a bare install lacks it
needs_accelerate = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                      reason="accelerate missing: pip install 'ferrylm[bench]'")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

TINY = {**PRESETS["qwen3-30b-a3b"].config, "hidden_size": 64, "intermediate_size": 48, "moe_intermediate_size": 16,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 96,
        "max_position_embeddings": 128, "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
        "bos_token_id": 1, "eos_token_id": 2}
TOKENS, PROMPT, BATCH = 6, 5, 2


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: one torch thread is fastest and immune to other processes on a 2-core box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _limit_for(spec: SyntheticSpec, layers_on_device: float) -> float:
    """A --gpu-memory-limit (GiB, with reserve 0) that holds the embedding and about ``layers_on_device`` layers."""
    net = am.build_empty(am.hf_config(spec), torch.float32)
    layer = sum(p.numel() * 4 for p in net.model.layers[0].parameters())
    embed = net.model.embed_tokens.weight.numel() * 4
    return (embed + layers_on_device * layer) / am.GiB


@needs_accelerate
def test_offloaded_tokens_equal_resident_and_hf_generate():
    spec = SyntheticSpec(SyntheticPreset("tiny-acc", "test", TINY), 4)
    common = dict(model=spec, device="cpu", dtype="float32", batch=BATCH, tokens=TOKENS, prompt_tokens=PROMPT,
                  reserve=0.0, progress=lambda s: None)
    ref, net = ao.run_accelerate_bench(gpu_memory_limit=None, keep_model=True, **common)
    # accelerate keeps room for one offloaded layer on the device: 2.5 layers of budget -> 1 resident layer
    off, off_net = ao.run_accelerate_bench(gpu_memory_limit=_limit_for(spec, 2.5), keep_model=True, **common)

    pl = off.placement
    assert pl["gpu_layers"] == [0] and pl["offloaded_layers"] == [1, 2, 3]
    assert "lm_head" in pl["offloaded_modules"] and pl["offloaded_bytes"] > 0
    assert ref.placement["offloaded_layers"] == [] and ref.placement["offloaded_bytes"] == 0
    # the offloaded layers really go through accelerate's hooks: weights on meta between forwards
    assert off_net.model.layers[2].mlp.experts.gate_up_proj.device.type == "meta"
    assert hasattr(off_net.model.layers[2], "_hf_hook")
    assert pl["experts"]["fused"] and pl["experts"]["params"]["gate_up_proj"] == [8, 32, 64]

    assert len(off.token_ids) == BATCH and all(len(t) == 1 + TOKENS for t in off.token_ids)
    assert off.token_ids == ref.token_ids and off.checksum == ref.checksum
    assert off.tok_s > 0 and off.decode_s > 0

    prompts, _ = ao.bench_prompt_tensors(TINY["vocab_size"], BATCH, PROMPT, seed=0)
    with torch.no_grad():
        out = net.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                           max_new_tokens=1 + TOKENS, min_new_tokens=1 + TOKENS, pad_token_id=0)
    gen = out[:, PROMPT:].tolist()
    # min_new_tokens only masks EOS; where greedy would pick EOS the two could differ, so that is checked first
    assert all(2 not in t for t in ref.token_ids)
    assert gen == ref.token_ids


@needs_accelerate
def test_cli_table_and_json(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(PRESETS, "tiny-acc", SyntheticPreset("tiny-acc", "test", TINY))
    limit = _limit_for(SyntheticSpec(PRESETS["tiny-acc"], 3), 2.5)
    out = tmp_path / "acc.json"
    rc = cli.main(["bench", "accelerate", "--model", "synthetic:tiny-acc:layers=3", "--device", "cpu",
                   "--dtype", "float32", "--gpu-memory-limit", f"{limit:.9f}", "--reserve", "0", "--batch", "1",
                   "--tokens", "3", "--prompt-tokens", "4", "--output-json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    lines = text.strip().splitlines()
    res = json.loads(lines[-1])
    assert res["model"] == "synthetic:tiny-acc:layers=3" and res["tokens"] == 3 and res["batch"] == 1
    assert res["architecture"] == "Qwen3MoeForCausalLM" and res["tok_s"] > 0
    assert res["placement"]["offloaded_layers"] == [1, 2]
    assert "placement unit: Qwen3MoeDecoderLayer" in text and "fused 3D parameters" in text
    assert "decoder layers offloaded" in text and "tok/s" in text
    saved = json.loads(out.read_text())
    assert saved["checksum"] == res["checksum"] and [len(t) for t in saved["token_ids"]] == [4]


def test_cli_without_accelerate_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "accelerate", None)  # import accelerate -> ImportError
    rc = cli.main(["bench", "accelerate", "--model", "synthetic:qwen3-30b-a3b:layers=2", "--device", "cpu"])
    assert rc == 2
    assert "pip install 'ferrylm[bench]'" in capsys.readouterr().err


def test_cli_rejects_bad_flags(capsys):
    assert cli.main(["bench", "accelerate", "--model", "smollm2-moe"]) == 2
    assert "synthetic:" in capsys.readouterr().err
    assert cli.main(["bench", "accelerate", "--model", "synthetic:qwen3-30b-a3b", "--tokens", "0"]) == 2
    assert cli.main(["bench", "accelerate", "--model", "synthetic:qwen3-30b-a3b", "--gpu-memory-limit", "1",
                     "--reserve", "1"]) == 2
    assert cli.main(["bench", "accelerate", "--model", "synthetic:nope", "--device", "cpu"]) == 2
    assert "unknown synthetic preset" in capsys.readouterr().err


@needs_accelerate
def test_plan_qwen3_30b_under_24_gib_meta_only():
    """The plan the H200 run gets (nothing allocated): whole decoder layers, 18 of 48 on the device."""
    net = am.build_empty(am.hf_config(parse_synthetic_spec("synthetic:qwen3-30b-a3b")), torch.bfloat16)
    assert next(net.parameters()).device.type == "meta"
    dm = am.plan_device_map(net, int(23 * am.GiB), 1024 * am.GiB, torch.bfloat16)
    pl = am.describe_placement(net, dm)
    assert pl["placement_unit"] == ["Qwen3MoeDecoderLayer"]
    assert pl["experts"] == {"class": "Qwen3MoeExperts", "fused": True,
                             "params": {"gate_up_proj": [128, 1536, 2048], "down_proj": [128, 2048, 768]},
                             "bytes_per_layer": 128 * 3 * 2048 * 768 * 2}
    assert len(pl["gpu_layers"]) + len(pl["offloaded_layers"]) == 48 and len(pl["offloaded_layers"]) >= 28
    assert pl["gpu_bytes"] + pl["offloaded_bytes"] == sum(p.numel() * 2 for p in net.parameters())
    assert pl["gpu_bytes"] + pl["layer_bytes"] <= 23 * am.GiB  # accelerate keeps room to load one layer
