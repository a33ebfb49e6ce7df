"""MoE GGUFs of every served architecture, written from tiny random transformers checkpoints in llama.cpp's layout
(tests/models/gguf_arch_files.py), are served from the file and give the logits of the same weights read from
safetensors (float32, within 1e-4; quantized experts: against the safetensors with gguf-py's dequantized experts);
a GGUF of an architecture not served is refused in one line naming it and the list."""

from __future__ import annotations

import pytest
import torch
from gguf import GGUFWriter
from tests.experts.helpers import exact_options
from tests.models.gguf_arch_files import VOCAB, build_hf, dequantized_folder, write_arch_gguf
from tests.models.gguf_moe_files import CHAT_TEMPLATE
from tests.models.hf_checkpoints import token_ids
from tests.models.test_parity import full_logits

from ferrylm.config import ModelConfig
from ferrylm.errors import ModelLoadError
from ferrylm.experts.quantized import QuantTensor
from ferrylm.checkpoints.gguf_tokenizer import gguf_tokenizer
from ferrylm.checkpoints.loader import load_model
from ferrylm.checkpoints.resolve import resolve_model

SERVED = "llama, qwen3moe, qwen2moe, olmoe, glm4moe, deepseek2, gpt-oss, minimax-m2, qwen3next, qwen35moe"


def _experts_q8_0(tensors: dict) -> dict:
    return {n: "Q8_0" for n in tensors if "_exps.weight" in n}


def _parity(tmp_path, case: str, family: str, types=None, overrides=None, **kw):
    """Write the GGUF of ``case``; assert its logits equal the safetensors ones; return the served model."""
    hf = build_hf(case, tmp_path / "hf", **(overrides or {}))
    path = write_arch_gguf(hf, tmp_path / f"{family}.gguf", family, types, **kw)
    ref_dir = dequantized_folder(hf, path, tmp_path / "ref", family) if types else hf
    served, ref = load_model(path, moe_backend=exact_options()), load_model(ref_dir, moe_backend=exact_options())
    assert served.config.architecture == ref.config.architecture
    ids = token_ids(24, VOCAB, seed=3)
    want = full_logits(ref.model, ids)
    err = (full_logits(served.model, ids) - want).abs().max().item()
    assert err <= 1e-4, (family, err, want.abs().max().item())
    return served, path


def test_glm4moe(tmp_path):
    """GLM-4.5: a dense first layer, q/k/v biases and q/k norms, half the head rotated, grouped biased sigmoid
    routing (``exp_probs_b``), one shared expert; Q8_0 experts kept as blocks; llama.cpp's nextn block (counted
    in ``block_count``) is not read; the tokenizer and chat template come from the file."""
    served, path = _parity(tmp_path, "glm4_moe", "glm4_moe", _experts_q8_0, mtp_layers=1)
    cfg = served.config
    assert cfg.num_layers == 3 and cfg.raw["rotary_dim"] == 16 and cfg.raw["n_group"] == 4
    le = served.executor.layers[1]
    assert isinstance(le.gate, QuantTensor) and le.gate.fmt.describe() == "Q8_0 (ggml blocks)"
    bias = served.model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32
    assert gguf_tokenizer(path).chat_template == CHAT_TEMPLATE
    assert resolve_model(str(path)).source == "gguf"


@pytest.mark.parametrize("split_kv_b", [True, False])
def test_deepseek2(tmp_path, split_kv_b):
    """DeepSeek-V3 (MLA): ``kv_b_proj`` from llama.cpp's ``attn_k_b`` (transposed) + ``attn_v_b``, or whole in older
    files; per-head dims from ``key_length_mla`` / ``value_length_mla`` or the older ``key_length`` / ``value_length``;
    yarn with ``mscale_all_dim`` from ``yarn_log_multiplier``; grouped biased sigmoid routing, a shared expert, two
    dense layers; Q8_0 experts. The older layout also without the query's low rank (one ``attn_q``)."""
    if split_kv_b:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                "mscale": 0.7, "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1}
        served, _ = _parity(tmp_path, "deepseek_v3", "deepseek_v3", _experts_q8_0, {"rope_parameters": rope})
        assert served.config.raw["q_lora_rank"] == 48 and served.config.raw["rope_parameters"]["mscale_all_dim"] == 0.7
    else:
        served, _ = _parity(tmp_path, "deepseek_v3_lite", "deepseek_v3", _experts_q8_0,
                            {"rope_interleave": True, "attention_bias": False}, split_kv_b=False)
        assert served.config.raw["q_lora_rank"] is None
    assert isinstance(served.executor.layers[served.config.raw["first_k_dense_replace"]].down, QuantTensor)


def test_gpt_oss_mxfp4(tmp_path):
    """gpt-oss: MXFP4 experts kept as their e2m1 codes and E8M0 scales (values equal gguf-py's dequantize), expert
    biases, attention sinks (float32), q/k/v/o biases, alternating sliding-window layers, yarn; every backend gives
    the resident model's greedy tokens."""
    from tests.experts.helpers import greedy_trace, options

    def mxfp4(tensors):
        return {n: "MXFP4" for n in tensors if "_exps.weight" in n}

    served, path = _parity(tmp_path, "gpt_oss", "gpt_oss", mxfp4, {"swiglu_limit": 7.0})
    assert served.config.raw["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    le = served.executor.layers[2]
    assert le.gate.fmt.kind == "fp4" and le.math is not None and le.math.limit == 7.0
    assert served.model.model.layers[0].self_attn.sinks.dtype == torch.float32
    import gguf
    import numpy as np

    raw = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    t = raw["blk.2.ffn_down_exps.weight"]
    want = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
    assert torch.equal(le.down.dequantize(torch.float32), want)
    prompt = token_ids(8, VOCAB, seed=9).tolist()
    tokens = greedy_trace(served.model, prompt, 4)[0]
    for backend in ("offload", "cpu"):
        assert greedy_trace(load_model(path, moe_backend=options(backend, 1)).model, prompt, 4)[0] == tokens, backend


def test_minimax_m2(tmp_path):
    """MiniMax-M2: q/k norms over the whole projection, half the head rotated (``rotary_dim``), biased sigmoid
    routing under ``block_sparse_moe``; F32 experts become plain stacks."""
    served, _ = _parity(tmp_path, "minimax_m2", "minimax_m2")
    assert served.config.raw["rotary_dim"] == 16
    assert not isinstance(served.executor.layers[0].gate, QuantTensor)
    assert served.model.model.layers[0].mlp.gate.e_score_correction_bias.dtype == torch.float32


def test_qwen3next(tmp_path):
    """Qwen3-Next: ``in_proj_qkvz`` regrouped from llama.cpp's ``attn_qkv`` + ``attn_gate``, norms stored as
    ``1 + w``, ``A_log`` as ``-exp``, the conv squeezed, layers linear / full by ``full_attention_interval``, a gated
    shared expert, two value heads per key head; Q8_0 experts. (llama.cpp's qwen3next has no dense layers.)"""
    served, _ = _parity(tmp_path, "qwen3_next", "qwen3_next", _experts_q8_0,
                        {"layer_types": None, "full_attention_interval": 2, "mlp_only_layers": []})
    assert served.config.raw["full_attention_interval"] == 2 and served.config.raw["linear_num_value_heads"] == 4


def test_qwen35moe(tmp_path):
    """Qwen3.5-MoE: its four DeltaNet projections with the value heads back from llama.cpp's tiled order (two
    value heads per key head), the same norm / ``A_log`` / conv changes undone."""
    served, _ = _parity(tmp_path, "qwen3_5_moe", "qwen3_5_moe", None,
                        {"linear_num_value_heads": 4, "linear_value_head_dim": 8})
    assert served.config.architecture == "Qwen3_5MoeForCausalLM"


def test_unsupported_architecture_is_one_line_naming_it(tmp_path):
    path = tmp_path / "other.gguf"
    w = GGUFWriter(str(path), "gemma3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    want = rf"other.gguf: GGUF architecture 'gemma3' is not supported; supported: {SERVED}$"
    for read in (lambda: resolve_model(str(path)), lambda: ModelConfig.from_folder(path), lambda: load_model(path)):
        with pytest.raises(ModelLoadError, match=want) as e:
            read()
        assert "\n" not in str(e.value)
