"""``--kv-cache-dtype fp8`` through the engine on tiny models (Qwen3-MoE, DeepSeek-V3's latent pool, Qwen3-Next's
full-attention layers): greedy tokens equal those of the unquantized KV pool, and the logprob drift of the chosen
tokens (prompt and output, teacher-forced on the same tokens) is measured, printed and bounded. The plan holds about
twice the tokens; a bad flag value is a CLI line naming the flag."""

from __future__ import annotations

import pytest
import torch

from ferrylm.config import EngineConfig
from ferrylm.engine.boot import engine_for_model
from ferrylm.engine.cache.kv_pool import FP8, KVLayout
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.checkpoints.loader import load_model
from tests.models.hf_checkpoints import token_ids

NEW_TOKENS = 16
# Tolerance. Float8 e4m3 keeps 3 mantissa bits (~3% error per head). Teacher-forced on the same tokens (the prompt,
# prefilled in 8-token chunks over 4-token pages, so later chunks read quantized pages), every token's logprob stays
# within MAX_PROMPT_DRIFT of the unquantized pool's. Greedy tokens are equal where the tiny random model's choice
# has a margin: Qwen3-MoE and DeepSeek-V2-Lite-shaped MLA; the tiny DeepSeek-V3 and Qwen3-Next checkpoints have
# nearly flat next-token distributions (the chosen token's logprob ~ -3.2 against ln(1/160) = -5.1), where a
# near-tie and their routers flip under any perturbation, so only their drift is bounded.
MAX_PROMPT_DRIFT, MAX_MEAN_PROMPT_DRIFT = 0.5, 0.1
MAX_OUTPUT_DRIFT = 0.1


def _run(ckpt, kv_cache_dtype: str, prompt: list[int], decode_graphs: str = "auto"):
    loaded = load_model(ckpt.path, device="cpu", dtype=torch.float32)
    cfg = EngineConfig(device="cpu", check_invariants=True, num_pages=32, page_size=4, max_prefill_length=8,
                       max_running_requests=2, max_model_len=128, kv_cache_dtype=kv_cache_dtype,
                       enable_prefix_caching=False, decode_graphs=decode_graphs)
    engine = engine_for_model(loaded.model, loaded.config, cfg, device=torch.device("cpu"), dtype=torch.float32)
    stored = [t for t in engine.pool.k if t.numel()]
    assert stored and all(t.dtype == (FP8 if kv_cache_dtype == "fp8" else torch.float32) for t in stored)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=0,
                            prompt_logprobs=0)
    engine.add_request("a", prompt, params)
    tokens, logprobs, prompt_lp = [], [], None
    for _ in range(500):
        if not engine.has_work():
            break
        for o in engine.step():
            assert o.error_code is None, o.error_message
            tokens.extend(o.new_token_ids)
            logprobs.extend(lp.logprob for lp in o.logprobs)
            if o.prompt_logprobs is not None:
                prompt_lp = [lp.logprob for lp in o.prompt_logprobs if lp is not None]
    if decode_graphs == "eager":
        assert engine.stats()["decode_graphs"]["steps"] >= NEW_TOKENS - 1
    return tokens, torch.tensor(logprobs), torch.tensor(prompt_lp)


@pytest.mark.parametrize("case", ["qwen3_moe", "deepseek_v3_lite"])
def test_fp8_kv_greedy_tokens_equal_the_unquantized_pool(checkpoints, case):
    ckpt = checkpoints(case)
    prompt = token_ids(23, ckpt.vocab_size, seed=22).tolist()
    ref_tokens, ref_lp, _ = _run(ckpt, "auto", prompt)
    tokens, lp, _ = _run(ckpt, "fp8", prompt)
    assert tokens == ref_tokens, f"{case}: fp8 KV changed the greedy tokens"
    drift = (lp - ref_lp).abs()
    print(f"{case}: fp8 KV, {NEW_TOKENS} greedy tokens equal; their logprob drift max {drift.max():.4f} mean "
          f"{drift.mean():.4f}")
    assert 0 < drift.max() < MAX_OUTPUT_DRIFT       # quantized (some drift), yet close


@pytest.mark.parametrize("case", ["qwen3_moe", "deepseek_v3_lite"])
def test_fp8_kv_piecewise_decode_equals_the_plain_decode(checkpoints, case):
    """``decode_graphs="eager"``: decode steps run the graphs' pieces (``StaticDecodeAttention`` over the fp8 pool:
    its store and dequantizing gather) and give the plain fp8 decode's tokens and logprobs."""
    ckpt = checkpoints(case)
    prompt = token_ids(23, ckpt.vocab_size, seed=22).tolist()
    plain_tokens, plain_lp, _ = _run(ckpt, "fp8", prompt, decode_graphs="off")
    tokens, lp, _ = _run(ckpt, "fp8", prompt, decode_graphs="eager")
    assert tokens == plain_tokens
    torch.testing.assert_close(lp, plain_lp, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["qwen3_moe", "deepseek_v3_lite", "deepseek_v3", "qwen3_next"])
def test_fp8_kv_teacher_forced_logprob_drift(checkpoints, case):
    ckpt = checkpoints(case)
    prompt = token_ids(23, ckpt.vocab_size, seed=22).tolist()
    _, _, ref = _run(ckpt, "auto", prompt)
    _, _, got = _run(ckpt, "fp8", prompt)
    drift = (got - ref).abs()
    print(f"{case}: fp8 KV logprob drift over {len(got)} teacher-forced prompt tokens: max {drift.max():.4f} "
          f"mean {drift.mean():.4f}")
    assert 0 < drift.max() < MAX_PROMPT_DRIFT and drift.mean() < MAX_MEAN_PROMPT_DRIFT


class _Qwen3MoeShape:
    """Qwen3-30B-A3B's attention: 48 layers, 4 KV heads of 128."""

    num_layers, num_kv_heads, head_dim = 48, 4, 128


def test_the_plan_holds_about_twice_the_tokens_with_fp8():
    from ferrylm.memory.budget import MemoryBudget
    from ferrylm.memory.plan import ExpertNeeds, PlanInputs, plan_memory
    from ferrylm.memory.probe import GiB, MiB

    layout = KVLayout.standard(_Qwen3MoeShape)
    bf16, fp8 = layout.bytes_per_token(torch.bfloat16), layout.bytes_per_token(torch.bfloat16, "fp8")
    assert bf16 == 48 * 2 * 4 * 128 * 2                      # 96 KiB: 12 GiB at 128k tokens
    assert fp8 == 48 * (2 * 4 * 128 + 2 * 4 * 4)             # values + one float32 scale per token and head
    latent = KVLayout(num_layers=61, layers=tuple(range(61)), k_heads=1, k_dim=576, v_heads=0, v_dim=0)
    assert latent.bytes_per_token(torch.bfloat16, "fp8") == 61 * (576 + 4)   # DeepSeek-V3's latent row, one scale

    def plan(per_tok: int):
        return plan_memory(PlanInputs(
            MemoryBudget(kind="cuda", total_bytes=24 * GiB, free_at_boot_bytes=23 * GiB, memory_ratio=0.95,
                         gpu_memory_limit_bytes=None, memory_reserve_bytes=None), weights_bytes=2 * GiB,
            workspace_bytes=GiB,
            workspace_source="measured", kv_bytes_per_token=per_tok, page_size=16, max_model_len=131072,
            max_running_requests=4, max_prefill_length=8192, moe_cache_size=100,
            experts=ExpertNeeds(slot_bytes=9 * MiB, fixed_bytes=GiB, total_experts=48 * 128, min_slots=1)))

    a, b = plan(bf16), plan(fp8)
    ratio = b.kv_tokens / a.kv_tokens
    print(f"plan: bf16 KV {a.kv_tokens} tokens, fp8 KV {b.kv_tokens} tokens (x{ratio:.2f})")
    assert 1.9 < ratio < 2.0


def test_a_bogus_kv_cache_dtype_is_a_cli_line_naming_the_flag(capsys):
    from ferrylm.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--kv-cache-dtype", "bogus"])
    assert "--kv-cache-dtype" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        EngineConfig(kv_cache_dtype="bogus").validate()
    args = build_parser().parse_args(["serve", "--model", "m", "--kv-cache-dtype", "fp8_e4m3"])
    assert args.kv_cache_dtype == "fp8_e4m3"
