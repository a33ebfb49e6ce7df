"""Synthetic models: presets with published shapes, spec parsing, seeded weights, Zipf-skewed routing, the folder
that stands for a spec, and token-ids-only generation (offline API and ``ferry generate``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ferrylm import cli
from ferrylm.errors import InvalidRequest, ModelLoadError
from ferrylm.synthetic import spec as synthetic
from ferrylm.models.reference_attention import DenseCausalAttention
from ferrylm.checkpoints.loader import load_model
from ferrylm.models.deepseek_v4 import HashRouter
from ferrylm.models.moe import SparseMoeBlock
from ferrylm.checkpoints.resolve import resolve_model
from ferrylm.synthetic.presets import PRESETS, SyntheticPreset
from ferrylm.synthetic.spec import SyntheticSpec, parse_synthetic_spec
from ferrylm.checkpoints.synthetic_build import build_synthetic, expert_ranks, top1_probs, zipf_probs

TINY_SHAPES = dict(hidden_size=64, intermediate_size=48, moe_intermediate_size=16, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=128)


def tiny(preset: str, experts: int = 8, **overrides) -> SyntheticPreset:
    """The architecture and options of a real preset, at test size."""
    cfg = {**PRESETS[preset].config, **TINY_SHAPES, "num_hidden_layers": 3, **overrides}
    cfg["num_local_experts" if "num_local_experts" in cfg else "num_experts"] = experts
    cfg["num_experts_per_tok"] = 2
    if "shared_expert_intermediate_size" in cfg:
        cfg["shared_expert_intermediate_size"] = 40
    if preset == "olmoe-1b-7b":
        cfg.pop("head_dim")
        cfg["intermediate_size"] = 16
    if "rotary_dim" in cfg:  # MiniMax-M2: half of the head rotated, as published (64 of 128)
        cfg["rotary_dim"] = cfg["head_dim"] // 2
    if "kv_lora_rank" in cfg:  # DeepSeek-V3 / Kimi-K2: MLA at test size, groups of 4 experts, one dense layer
        cfg.pop("num_experts")
        cfg.update(n_routed_experts=experts, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
                   qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, num_key_value_heads=4,
                   n_group=min(cfg["n_group"], experts // 4), topk_group=1)
    if "hc_mult" in cfg:  # DeepSeek-V4: one KV head, its compressors, indexer and grouped output at test size
        cfg.pop("num_experts")
        cfg.update(n_routed_experts=experts, num_key_value_heads=1, q_lora_rank=24, o_groups=2, o_lora_rank=16,
                   index_n_heads=4, index_head_dim=16, index_topk=2, sliding_window=4, partial_rotary_factor=0.25,
                   compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8})
    return SyntheticPreset(f"tiny-{preset}", "test", cfg)


def logits(loaded, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return loaded.model.compute_logits(loaded.model(ids, torch.arange(len(ids)), DenseCausalAttention()))


def test_presets_have_the_published_shapes():
    want = {  # name: (arch, layers, hidden, experts, top_k, expert width, q heads, kv heads, head_dim, vocab)
        "qwen3-30b-a3b": ("Qwen3MoeForCausalLM", 48, 2048, 128, 8, 768, 32, 4, 128, 151936),
        "qwen3-235b-a22b": ("Qwen3MoeForCausalLM", 94, 4096, 128, 8, 1536, 64, 4, 128, 151936),
        "olmoe-1b-7b": ("OlmoeForCausalLM", 16, 2048, 64, 8, 1024, 16, 16, 128, 50304),
        "mixtral-8x7b": ("MixtralForCausalLM", 32, 4096, 8, 2, 14336, 32, 8, 128, 32000),
        "qwen2-57b-a14b": ("Qwen2MoeForCausalLM", 28, 3584, 64, 8, 2560, 28, 4, 128, 151936),
        "glm-4.5-air": ("Glm4MoeForCausalLM", 46, 4096, 128, 8, 1408, 96, 8, 128, 151552),
        "minimax-m2": ("MiniMaxM2ForCausalLM", 62, 3072, 256, 8, 1536, 48, 8, 128, 200064),
        "minimax-m2.5": ("MiniMaxM2ForCausalLM", 62, 3072, 256, 8, 1536, 48, 8, 128, 200064),
        "qwen3-next-80b-a3b": ("Qwen3NextForCausalLM", 48, 2048, 512, 10, 512, 16, 2, 256, 151936),
        "qwen3.5-35b-a3b": ("Qwen3_5MoeForCausalLM", 40, 2048, 256, 8, 512, 16, 2, 256, 248320),
        "qwen3.8-flash-next": ("Qwen4ExpForCausalLM", 48, 2560, 512, 10, 640, 24, 2, 256, 248320),
        "gpt-oss-20b": ("GptOssForCausalLM", 24, 2880, 32, 4, 2880, 64, 8, 64, 201088),
        "gpt-oss-120b": ("GptOssForCausalLM", 36, 2880, 128, 4, 2880, 64, 8, 64, 201088),
        "deepseek-v4-flash": ("DeepseekV4ForCausalLM", 43, 4096, 256, 6, 2048, 64, 1, 512, 129280),
    }
    from ferrylm.config import ModelConfig

    mla = {  # name: (layers, hidden, experts, top_k, width, heads, q_lora, kv_lora, nope, rope, v, dense layers,
        #        n_group, topk_group, routed_scaling_factor, vocab, yarn factor)
        "deepseek-v3": (61, 7168, 256, 8, 2048, 128, 1536, 512, 128, 64, 128, 3, 8, 4, 2.5, 129280, 40),
        "kimi-k2": (61, 7168, 384, 8, 2048, 64, 1536, 512, 128, 64, 128, 1, 1, 1, 2.827, 163840, 64),
    }
    assert set(PRESETS) == set(want) | set(mla)
    for name, w in mla.items():
        c = ModelConfig.from_dict(PRESETS[name].config)
        r = c.raw
        got = (c.num_layers, c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
               c.num_heads, r["q_lora_rank"], r["kv_lora_rank"], r["qk_nope_head_dim"], r["qk_rope_head_dim"],
               r["v_head_dim"], r["first_k_dense_replace"], r["n_group"], r["topk_group"], r["routed_scaling_factor"],
               c.vocab_size, c.rope_scaling["factor"])
        assert c.architecture == "DeepseekV3ForCausalLM" and got == w, name
        assert r["n_shared_experts"] == 1 and c.intermediate_size == 18432
    for name, w in want.items():
        c = ModelConfig.from_dict(PRESETS[name].config)
        got = (c.architecture, c.num_layers, c.hidden_size, c.num_experts, c.num_experts_per_tok,
               c.moe_intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size)
        assert got == w, name
    q3 = PRESETS["qwen3-30b-a3b"].config
    assert q3["rope_theta"] == 1e6 and q3["norm_topk_prob"] is True and q3["tie_word_embeddings"] is False
    assert PRESETS["qwen2-57b-a14b"].config["shared_expert_intermediate_size"] == 20480
    assert PRESETS["olmoe-1b-7b"].config["norm_topk_prob"] is False
    for name in ("minimax-m2", "minimax-m2.5"):  # half the head rotated, biased sigmoid routing, no shared expert
        m = PRESETS[name].config
        assert (m["rotary_dim"], m["scoring_func"], m["use_routing_bias"], m["shared_intermediate_size"],
                m["use_qk_norm"], m["eos_token_id"]) == (64, "sigmoid", True, 0, True, 200020), name


def test_spec_parsing_and_errors(tmp_path):
    s = parse_synthetic_spec("synthetic:qwen3-30b-a3b:layers=2:skew=1.2:seed=7")
    assert (s.preset.name, s.layers, s.skew, s.seed, s.tokenizer) == ("qwen3-30b-a3b", 2, 1.2, 7, None)
    assert s.name == "synthetic:qwen3-30b-a3b:layers=2:skew=1.2:seed=7"
    assert parse_synthetic_spec("synthetic:mixtral-8x7b").name == "synthetic:mixtral-8x7b"  # defaults left out
    cfg = s.config()
    assert cfg["num_hidden_layers"] == 2 and cfg["hidden_size"] == 2048 and cfg["ferrylm_router_bias"] is True
    tok = tmp_path / "odd:name"
    tok.mkdir()
    s = parse_synthetic_spec(f"synthetic:olmoe-1b-7b:seed=1:tokenizer={tok}")  # the path may contain ':'
    assert s.tokenizer == str(tok.resolve()) and s.name == "synthetic:olmoe-1b-7b:seed=1"
    for bad, msg in [("synthetic:qwen9", "presets: qwen3-30b-a3b"), ("synthetic:mixtral-8x7b:layers=33", "1..32"),
                     ("synthetic:mixtral-8x7b:layers=0", "1..32"), ("synthetic:mixtral-8x7b:skew=-1", "skew"),
                     ("synthetic:mixtral-8x7b:skew=inf", "skew"), ("synthetic:mixtral-8x7b:depth=2", "unknown option"),
                     ("synthetic:mixtral-8x7b:seed=1:seed=2", "twice"), ("synthetic:mixtral-8x7b:layers=x", "bad"),
                     (f"synthetic:mixtral-8x7b:tokenizer={tmp_path / 'none'}", "does not exist")]:
        with pytest.raises(ModelLoadError, match=msg):
            parse_synthetic_spec(bad)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_architecture_builds_seeded(preset):
    spec = SyntheticSpec(tiny(preset), layers=3, skew=0.8, seed=3)
    ids = torch.tensor([5, 17, 3, 90, 41, 8])
    a, b = build_synthetic(spec), build_synthetic(spec)
    la = logits(a, ids)
    assert la.shape == (6, 96) and torch.isfinite(la).all()
    assert torch.equal(la, logits(b, ids))  # same seed, same weights, same logits
    assert not torch.equal(la, logits(build_synthetic(SyntheticSpec(spec.preset, 3, 0.8, seed=4)), ids))
    keep32 = type(a.model).float32_tensors  # routing tensors the class keeps in float32
    assert {p.dtype for n, p in a.model.named_parameters() if not n.endswith(keep32)} == {torch.bfloat16}
    assert {p.dtype for n, p in a.model.named_parameters() if n.endswith(keep32)} <= {torch.float32}
    blocks = [m for m in a.model.modules() if isinstance(m, SparseMoeBlock)]
    hashed = [m for m in blocks if isinstance(m.gate, HashRouter)]   # DeepSeek-V4: chosen by token, no skew
    assert blocks and all(blk.gate.bias is not None for blk in blocks if blk not in hashed)
    assert sorted(a.executor.layers) == [blk.layer_idx for blk in blocks]
    if preset == "qwen2-57b-a14b":
        assert all(blk.shared_expert is not None for blk in blocks)


def test_layers_keeps_per_layer_shapes_and_mlp_only_layers():
    preset = tiny("qwen3-30b-a3b", num_hidden_layers=6, mlp_only_layers=[1, 4])
    loaded = build_synthetic(SyntheticSpec(preset, layers=3))
    assert loaded.config.num_layers == 3 and loaded.config.raw["mlp_only_layers"] == [1]
    assert sorted(loaded.executor.layers) == [0, 2]
    ex = loaded.executor.layers[0]
    assert tuple(ex.gate.shape) == (8, 16, 64) and tuple(ex.down.shape) == (8, 64, 16)
    full = synthetic.synthetic_config(parse_synthetic_spec("synthetic:qwen3-235b-a22b:layers=1"))
    assert full["num_hidden_layers"] == 1
    assert {k: v for k, v in full.items() if k not in ("num_hidden_layers", "max_window_layers", "torch_dtype",
                                                        synthetic.RECIPE_KEY, synthetic.ROUTING_KEY)} == \
        {k: v for k, v in PRESETS["qwen3-235b-a22b"].config.items() if k not in ("num_hidden_layers",
                                                                                  "max_window_layers")}


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = a.argsort().argsort().double(), b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def _top1_frequencies(block: SparseMoeBlock, hidden: int, n: int = 20000) -> torch.Tensor:
    x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(11))
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))  # what the RMSNorm before the router hands it
    with torch.no_grad():
        ids, _ = block.route(x.to(block.gate.weight.dtype))
    counts = torch.bincount(ids[:, 0], minlength=block.num_experts).double()
    return counts / counts.sum()


@pytest.mark.parametrize("preset_name,layers", [("qwen3-30b-a3b", (0, 1)), ("glm-4.5-air", (1, 2)),
                                                ("minimax-m2", (0, 1))])
@pytest.mark.parametrize("skew", [0.0, 0.7, 1.2])
def test_skew_gives_zipf_top1_popularity(skew, preset_name, layers):
    """128 experts (the Qwen3-MoE and GLM-4.5-Air count), random unit-RMS router inputs: measured top-1 frequencies
    follow the intended Zipf law, in ranking (Spearman) and in size (the head of the distribution). The sigmoid
    routers (GLM-4.5-Air: layer 0 dense) take the bias on their logits, so the same law holds for their choice."""
    preset = tiny(preset_name, experts=128, hidden_size=512, moe_intermediate_size=4, num_hidden_layers=3)
    loaded = build_synthetic(SyntheticSpec(preset, layers=3, skew=skew, seed=5))
    for layer in layers:
        block = loaded.model.model.layers[layer].mlp
        freq = _top1_frequencies(block, 512)
        intended = zipf_probs(128, skew)[expert_ranks(128, 5, layer) - 1]
        if skew == 0:
            assert block.gate.bias is None
            assert freq.max() < 1.5 / 128 and freq.min() > 0.5 / 128  # uniform up to sampling noise
            continue
        assert _spearman(freq, intended) > 0.9
        top = intended.argsort(descending=True)[:5]
        torch.testing.assert_close(freq[top], intended[top], rtol=0.2, atol=0.004)
    r0, r1 = expert_ranks(128, 5, layers[0]), expert_ranks(128, 5, layers[1])
    assert not torch.equal(r0, r1)  # each layer has its own popular experts


def test_calibrated_bias_solves_the_gaussian_top1_law():
    from ferrylm.checkpoints.synthetic_build import calibrated_bias

    for e, skew in [(8, 1.0), (64, 2.0), (128, 0.5)]:
        bias = calibrated_bias(e, skew, seed=0, layer_idx=0)
        target = zipf_probs(e, skew)[expert_ranks(e, 0, 0) - 1]
        torch.testing.assert_close(top1_probs(bias.double()), target, rtol=1e-4, atol=1e-7)
        naive = top1_probs(torch.log(target))  # adding log p over-sharpens Gaussian logits
        assert naive.max() > 1.2 * target.max()


def test_folder_stands_for_the_spec(tmp_path):
    spec = SyntheticSpec(tiny("olmoe-1b-7b"), layers=2, skew=0.5, seed=9)
    folder = synthetic.materialize(spec, tmp_path)
    assert synthetic.materialize(spec, tmp_path) == folder  # built once
    assert [p.name for p in folder.iterdir()] == ["config.json"]  # no weights written
    assert synthetic.is_synthetic_folder(folder) and not synthetic.is_synthetic_folder(tmp_path)
    ids = torch.tensor([1, 2, 3, 60])
    assert torch.equal(logits(load_model(folder, dtype=torch.bfloat16), ids), logits(build_synthetic(spec), ids))
    f32 = load_model(folder, dtype=torch.float32, expert_device="cpu")
    assert f32.executor.layers[0].gate.dtype == torch.float32


def test_resolve_synthetic(cache_env):
    r = resolve_model("synthetic:qwen3-30b-a3b:layers=2")
    assert (r.name, r.source, r.has_tokenizer) == ("synthetic:qwen3-30b-a3b:layers=2", "synthetic", False)
    cfg = json.loads((r.path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert resolve_model("synthetic:qwen3-30b-a3b:layers=2").path == r.path
    assert resolve_model("synthetic:qwen3-30b-a3b:layers=3").path != r.path


def test_resolve_synthetic_with_tokenizer(cache_env, tmp_path):
    tok_dir = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "qwen3-tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        pytest.skip(f"the real Qwen3 tokenizer is absent: {tok_dir}")
    spec = synthetic.with_tokenizer("synthetic:qwen3-30b-a3b:layers=2", str(tok_dir))
    r = resolve_model(spec)
    assert r.name == "synthetic:qwen3-30b-a3b:layers=2" and r.has_tokenizer
    assert (r.path / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()
    assert r.path != resolve_model("synthetic:qwen3-30b-a3b:layers=2").path
    from ferrylm.server.text.tokenizer import TextCodec

    assert TextCodec.from_pretrained(r.path).encode("Hello world!", add_special_tokens=False) == [9707, 1879, 0]
    with pytest.raises(ModelLoadError, match="beyond the vocabulary of mixtral-8x7b"):
        resolve_model(synthetic.with_tokenizer("synthetic:mixtral-8x7b:layers=1", str(tok_dir)))
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        resolve_model(synthetic.with_tokenizer("synthetic:mixtral-8x7b:layers=1", str(tmp_path)))
    with pytest.raises(ModelLoadError, match="synthetic: models only"):
        synthetic.with_tokenizer("smollm2-moe", str(tok_dir))


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("FERRYLM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def tiny_registered(monkeypatch, cache_env):
    """A tiny Qwen3-MoE preset reachable as ``synthetic:tiny-test``."""
    preset = SyntheticPreset("tiny-test", "test", tiny("qwen3-30b-a3b").config)
    monkeypatch.setitem(PRESETS, "tiny-test", preset)
    return preset


def test_llm_token_ids_only(tiny_registered):
    from ferrylm.engine.sampling_params import SamplingParams
    from ferrylm.llm import LLM

    llm = LLM("synthetic:tiny-test", device="cpu", num_pages=16, check_invariants=True)
    assert llm.codec is None and llm.engine.model.model.embed_tokens.weight.dtype == torch.bfloat16
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    out = llm.generate([[1, 2, 3], [4, 5]], params)
    assert [len(o.outputs[0].token_ids) for o in out] == [5, 5]
    assert all(o.outputs[0].finish_reason == "length" and o.outputs[0].text == "" for o in out)
    again = LLM("synthetic:tiny-test", device="cpu", num_pages=16).generate([[1, 2, 3]], params)
    assert again[0].outputs[0].token_ids == out[0].outputs[0].token_ids  # seeded weights
    with pytest.raises(InvalidRequest, match="no tokenizer"):
        llm.generate(["hello"], params)
    with pytest.raises(InvalidRequest, match="no tokenizer"):
        llm.chat([[{"role": "user", "content": "hi"}]], params)


def test_cli_generate_prints_token_ids(tiny_registered, capsys):
    assert cli.main(["generate", "--model", "synthetic:tiny-test", "--max-tokens", "4", "--device", "cpu",
                     "--num-pages", "16", "--log-level", "WARNING"]) == 0
    ids = capsys.readouterr().out.split()
    assert len(ids) == 4 and all(0 <= int(t) < 96 for t in ids)
    assert cli.main(["generate", "--model", "synthetic:tiny-test", "--max-tokens", "3", "--device", "cpu",
                     "--num-pages", "16", "--log-level", "WARNING", "7, 8 9"]) == 0
    assert len(capsys.readouterr().out.split()) == 3
    assert cli.main(["generate", "--model", "synthetic:tiny-test", "--log-level", "WARNING", "hello"]) == 2
    assert "token ids" in capsys.readouterr().err


def test_cli_models_and_tokenizer_flag_errors(capsys, tmp_path):
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    for needle in ["smollm2-moe", "synthetic:qwen3-30b-a3b", "128 experts top-8 width 768", "Qwen3MoeForCausalLM",
                   "OlmoeForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM"]:
        assert needle in out
    with pytest.raises(SystemExit):
        cli.main(["generate", "--model", "smollm2-moe", "--tokenizer", str(tmp_path), "hi"])
    assert "synthetic: models only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["serve", "--model", "synthetic:qwen3-30b-a3b:layers=1", "--port", "1"])
    assert "needs --tokenizer" in capsys.readouterr().err
    with pytest.raises(SystemExit):   # the unknown preset first, not the missing --tokenizer (fresh-user trial)
        cli.main(["serve", "--model", "synthetic:nosuchpreset", "--port", "1"])
    assert "unknown synthetic preset 'nosuchpreset'" in capsys.readouterr().err


@pytest.mark.slow
def test_done_when_qwen3_30b_two_layers_generates_on_cpu(cache_env):
    """The issue's acceptance command, as a user runs it (about 5 GB of memory, 10-20 s)."""
    cmd = [sys.executable, "-m", "ferrylm.cli", "generate", "--model", "synthetic:qwen3-30b-a3b:layers=2",
               "--max-tokens", "8", "--log-level", "WARNING"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL,
                          env={**os.environ, "FERRYLM_CACHE_DIR": str(cache_env)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    ids = [int(t) for t in proc.stdout.split()]
    assert len(ids) == 8 and all(0 <= t < 151936 for t in ids)
    assert len(set(ids)) > 1  # random weights of real shape, not a degenerate constant


def _parameter_counts(preset: str) -> tuple[int, int]:
    """``(total, active)`` parameters of the preset's model as ferrylm builds it (on the meta device, no memory):
    every module parameter plus the routed experts' stacks; active = what one token touches outside the embedding
    and the LM head (attention, dense MLPs, routers, shared experts, ``top_k`` routed experts per MoE layer)."""
    from ferrylm.config import ModelConfig
    from ferrylm.experts.executor import LayerExperts
    from ferrylm.experts.resident import ResidentExecutor
    from ferrylm.models.registry import get_model_class

    config = ModelConfig.from_dict(PRESETS[preset].config)
    cls = get_model_class(config.architecture)
    cls.check_config(config)
    e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
    moe = cls.moe_layer_indices(config)
    with torch.device("meta"):
        stacks = {n: LayerExperts(gate=torch.empty(e, i, h), up=torch.empty(e, i, h), down=torch.empty(e, h, i))
                  for n in moe}
        model = cls(config, executor=ResidentExecutor(stacks), device="cpu")  # RoPE tables: real, small
    params = dict(model.named_parameters())
    dense = sum(p.numel() for p in params.values())
    embed = sum(p.numel() for n, p in params.items() if n.startswith(("model.embed_tokens", "lm_head")))
    per_expert = 3 * h * i
    return dense + len(moe) * e * per_expert, dense - embed + len(moe) * config.num_experts_per_tok * per_expert


@pytest.mark.parametrize("preset,total,active,embeddings", [
    ("glm-4.5-air", 106e9, 12e9, False), ("minimax-m2", 230e9, 10e9, False),
    ("minimax-m2.5", 230e9, 10e9, False),
    ("deepseek-v3", 671e9, 37e9, True), ("kimi-k2", 1.04e12, 32.6e9, True)])
def test_preset_parameter_counts_match_the_published_totals(preset, total, active, embeddings):
    """GLM-4.5-Air: 106B total / 12B active (zai-org model card); MiniMax-M2 and M2.5: 230B / 10B (MiniMax model
    cards); DeepSeek-V3: 671B / 37B without its 14B MTP module (technical report, §1); Kimi-K2: 1.04T / 32.6B (its
    technical report); those two count the embedding and the output head as active (``embeddings``).
    Within 3 %: the published totals round, and leave out the MTP layers ferrylm does not build."""
    got_total, got_active = _parameter_counts(preset)
    if embeddings:
        c = PRESETS[preset].config
        got_active += 2 * c["vocab_size"] * c["hidden_size"]
    assert abs(got_total / total - 1) < 0.03, f"{preset}: {got_total / 1e9:.1f}B total"
    assert abs(got_active / active - 1) < 0.03, f"{preset}: {got_active / 1e9:.2f}B active"


@pytest.mark.parametrize("preset,total,active", [("gpt-oss-20b", 20.91e9, 3.61e9),
                                                ("gpt-oss-120b", 116.83e9, 5.13e9)])
def test_gpt_oss_presets_match_the_model_card(preset, total, active):
    """gpt-oss model card (OpenAI 2025, table 1): 20.91B total / 3.61B active, 116.83B / 5.13B; its active count
    includes the unembedding. The expert biases (not module parameters here) are added; within 1 %."""
    c = PRESETS[preset].config
    e, h, i, layers = c["num_local_experts"], c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    got_total, got_active = _parameter_counts(preset)
    got_total += layers * e * (2 * i + h)
    got_active += c["vocab_size"] * h + layers * c["num_experts_per_tok"] * (2 * i + h)
    assert abs(got_total / total - 1) < 0.01, f"{preset}: {got_total / 1e9:.2f}B total"
    assert abs(got_active / active - 1) < 0.01, f"{preset}: {got_active / 1e9:.2f}B active"


@pytest.mark.parametrize("preset", ["glm-4.5-air", "minimax-m2", "deepseek-v3", "kimi-k2"])
def test_memory_estimate_counts_what_the_model_holds(preset):
    """experts/auto.py's estimate of the non-expert bytes (what the auto backend choice plans with) agrees with
    the model's parameters within 0.1 % (GLM's ungated shared experts, its dense first layer)."""
    from ferrylm.config import ModelConfig
    from ferrylm.experts.auto import estimate_non_expert_bytes
    from ferrylm.models.registry import get_model_class

    config = ModelConfig.from_dict(PRESETS[preset].config)
    moe = get_model_class(config.architecture).moe_layer_indices(config)
    total, _ = _parameter_counts(preset)
    experts = len(moe) * config.num_experts * 3 * config.hidden_size * config.moe_intermediate_size
    assert abs(estimate_non_expert_bytes(config, moe, 1) / (total - experts) - 1) < 1e-3


def test_minimax_m2_5_parameter_total():
    """MiniMax-M2.5 as built: 228,689,764,864 parameters (228.7B; published 230B total, 229B by the checkpoint's
    count), 9.80B active without the embedding and the head; per layer: attention q/o 3072 x 6144, k/v 3072 x 1024,
    q/k norms over the whole projection, router 256 x 3072 and its bias, 256 experts of 3 x 3072 x 1536."""
    c = PRESETS["minimax-m2.5"].config
    h, e, i, layers = c["hidden_size"], c["num_local_experts"], c["intermediate_size"], c["num_hidden_layers"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    per_layer = 2 * h * q + 2 * h * kv + q + kv + 2 * h + e * h + e + e * 3 * h * i
    closed_form = layers * per_layer + 2 * c["vocab_size"] * h + h
    total, active = _parameter_counts("minimax-m2.5")
    assert total == closed_form == 228_689_764_864
    assert active == layers * (per_layer - (e - c["num_experts_per_tok"]) * 3 * h * i) + h == 9_801_359_872


def test_minimax_m2_5_nvfp4_spec(cache_env):
    """``synthetic:minimax-m2.5:layers=2:quant=nvfp4`` resolves to a folder whose config plans NVFP4 routed experts
    (fp4 e2m1, fp8 scale per 16 inputs, float32 per-row scale: 0.5625 bytes a weight and 4 bytes a row), and the
    architecture builds with them at test size, every backend giving the resident one's greedy tokens."""
    from ferrylm.checkpoints.quant import planned_expert_quant
    from ferrylm.config import ModelConfig
    from ferrylm.engine.expert_choice import model_host_bytes
    from ferrylm.experts.quantized import QuantFormat
    from tests.experts.helpers import greedy_trace, options

    r = resolve_model("synthetic:minimax-m2.5:layers=2:quant=nvfp4")
    assert r.name == "synthetic:minimax-m2.5:layers=2:quant=nvfp4"
    config = ModelConfig.from_folder(r.path)
    assert (config.architecture, config.num_layers, config.num_experts) == ("MiniMaxM2ForCausalLM", 2, 256)
    nvfp4 = QuantFormat("fp4", 16, torch.float8_e4m3fn, row_scale=True)
    planned = planned_expert_quant(config.raw)
    assert (planned.gate_up, planned.down) == (nvfp4, nvfp4)
    host, _ = model_host_bytes(config, torch.device("cuda"), torch.bfloat16, "offload")
    h, i = 3072, 1536
    assert host == 2 * 256 * (3 * h * i * 9 // 16 + 4 * (2 * i + h))
    spec = SyntheticSpec(tiny("minimax-m2.5"), 3, quant="nvfp4")
    ref = build_synthetic(spec, dtype=torch.float32)
    assert ref.executor.layers[0].gate.fmt == nvfp4
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = greedy_trace(ref.model, prompt, 4)[0]
    for backend in ("offload", "cpu", "hybrid"):
        got = greedy_trace(build_synthetic(spec, dtype=torch.float32, moe_backend=options(backend, 2)).model, prompt, 4)
        assert got[0] == want, backend


def test_deepseek_v4_flash_parameter_total():
    """DeepSeek-V4-Flash as built: 284B total, 13B active (its model card's figures; active here without the
    embedding and the head, which this family names ``embed`` / ``head``); the routed experts alone
    43 x 256 x 3 x 4096 x 2048."""
    total, active = _parameter_counts("deepseek-v4-flash")
    c = PRESETS["deepseek-v4-flash"].config
    active -= 2 * c["vocab_size"] * c["hidden_size"]
    assert 43 * 256 * 3 * 4096 * 2048 == 277_025_390_592
    assert abs(total / 284e9 - 1) < 0.01, f"{total / 1e9:.2f}B total"
    assert abs(active / 13e9 - 1) < 0.03, f"{active / 1e9:.2f}B active"
