"""MoE GGUF files (qwen3moe with k-quant experts, Mixtral as ``llama``, Qwen2-MoE and OLMoE with Q8_0 experts) served
from the file with their experts kept as GGML blocks: expert values equal gguf-py's ``dequantize`` bit for bit,
logits match transformers on the gguf-py-dequantized weights, every backend gives the same greedy tokens, and the
chat template comes from the file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from tests.experts.helpers import exact_options, greedy_trace, options
from tests.models.gguf_moe_files import (CHAT_TEMPLATE, byte_vocab, pack_q4_k, pack_q6_k, permute_rope_rows,
                                        write_moe_gguf)
from tests.models.hf_checkpoints import _randomize_, token_ids
from tests.models.quant_checkpoints import dense_reference
from tests.models.test_parity import full_logits
from safetensors.torch import load_file

from ferrylm.experts.quantized import QuantTensor
from ferrylm.checkpoints.gguf_config import gguf_config
from ferrylm.checkpoints.gguf_reader import unpermute_rope_rows
from ferrylm.server.text.tokenizer import TextCodec
from ferrylm.checkpoints.loader import load_model

VOCAB = len(byte_vocab()[0])
_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
          "block_sparse_moe.gate": "ffn_gate_inp", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_EXPERT = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps", "w3": "ffn_up_exps",
           "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}


def _hf_model(family: str, **kw):
    cfg = getattr(transformers, {"qwen3_moe": "Qwen3MoeConfig", "mixtral": "MixtralConfig",
                                 "qwen2_moe": "Qwen2MoeConfig", "olmoe": "OlmoeConfig"}[family])(
        vocab_size=VOCAB, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1, **kw)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    _randomize_(model, 3)
    return model.eval()


def _to_gguf(model, tmp_path, arch: str, types) -> tuple:
    """Save ``model`` (HF folder) and write its GGUF; returns ``(hf dir, gguf path, {hf name: gguf name (+ expert
    index)})``."""
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    sd = load_file(str(hf_dir / "model.safetensors"))
    tensors, where = {}, {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in sd.items():
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"], where[name] = t, ("token_embd.weight", None)
        elif name == "model.norm.weight":
            tensors["output_norm.weight"], where[name] = t, ("output_norm.weight", None)
        elif name == "lm_head.weight":
            tensors["output.weight"], where[name] = t, ("output.weight", None)
        elif ".experts." in name:
            p = name.split(".")
            g = f"blk.{p[2]}.{_EXPERT[p[6]]}.weight"
            stacks.setdefault(g, {})[int(p[5])] = t
            where[name] = (g, int(p[5]))
        else:
            p = name.split(".")
            mid = ".".join(p[3:-1])
            g = f"blk.{p[2]}.{_NAMES[mid]}.{p[-1]}"
            if arch == "llama" and mid in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg["num_attention_heads"] if mid.endswith("q_proj") else cfg["num_key_value_heads"]
                t = permute_rope_rows(t, heads)
            tensors[g], where[name] = t, (g, None)
    for g, per in stacks.items():
        tensors[g] = torch.stack([per[e] for e in sorted(per)])
    path = write_moe_gguf(tmp_path / "model.gguf", arch, cfg, tensors, types(tensors))
    return hf_dir, path, where


def _gguf_reference(path, where, arch, cfg) -> dict[str, torch.Tensor]:
    """Every HF weight as gguf-py's reader + ``dequantize`` give it (un-permuting the llama Q/K rows back)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    deq = {t.name: torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), copy=True))
           for t in reader.tensors}
    out = {}
    for hf, (g, e) in where.items():
        w = deq[g].float()  # gguf-py gives PyTorch order ([..., N, K])
        if e is not None:
            w = w[e]
        if arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            heads = cfg["num_attention_heads"] if ".q_proj." in hf else cfg["num_key_value_heads"]
            w = torch.from_numpy(unpermute_rope_rows(w.numpy(), heads))
        out[hf] = w.contiguous()
    return out


def _check(tmp_path, hf_dir, path, where, arch, want_formats) -> None:
    cfg = json.loads((hf_dir / "config.json").read_text())
    assert TextCodec.from_pretrained(path).chat_template == CHAT_TEMPLATE
    loaded = load_model(path, moe_backend=exact_options())
    quant = loaded.executor.layers[next(iter(loaded.executor.layers))]
    assert isinstance(quant.gate, QuantTensor)
    assert (quant.gate.fmt.describe(), quant.down.fmt.describe()) == want_formats
    reference = _gguf_reference(path, where, arch, cfg)
    for hf, w in reference.items():
        if ".experts." in hf:
            p = hf.split(".")
            le = loaded.executor.layers[int(p[2])]
            qt = {"gate_proj": le.gate, "w1": le.gate, "up_proj": le.up, "w3": le.up}.get(p[6], le.down)
            assert torch.equal(qt[int(p[5])].dequantize(torch.float32), w), hf
    ref_model = dense_reference(hf_dir, tmp_path / "dequantized", reference)
    ids = token_ids(20, VOCAB, seed=4)
    with torch.no_grad():
        ref = ref_model(input_ids=ids[None]).logits[0]
    err = (full_logits(loaded.model, ids) - ref).abs().max().item()
    print(f"{arch} {want_formats}: experts equal gguf-py's dequantize bit for bit; logits max |ours - ref| {err:.3g}")
    assert err <= 1e-4
    prompt = token_ids(8, VOCAB, seed=9).tolist()
    want = greedy_trace(loaded.model, prompt, 4)[0]
    for backend in ("resident", "offload", "cpu", "hybrid"):   # resident: the native kernel, the CPU default
        assert greedy_trace(load_model(path, moe_backend=options(backend, 1)).model, prompt, 4)[0] == want


@pytest.mark.parametrize("block", ["Q4_K", "Q6_K"])
def test_k_quant_packers_match_gguf_dequantize(block):
    """Our test packers write blocks gguf-py's reference dequantizer reads as (roughly) the packed weights."""
    from gguf.quants import dequantize

    w = torch.randn(4, 512, generator=torch.Generator().manual_seed(1)).numpy()
    raw = pack_q4_k(w) if block == "Q4_K" else pack_q6_k(w)
    back = dequantize(raw, getattr(__import__("gguf").GGMLQuantizationType, block))
    assert back.shape == w.shape and np.abs(back - w).max() < (0.25 if block == "Q4_K" else 0.08)


def test_qwen3moe_q4_k_and_q6_k(tmp_path):
    """gate/up Q4_K (kept as blocks); down Q6_K in layer 1 and Q4_K in layer 2, as llama.cpp's Q4_K_M mixes them
    (kept as blocks, ``kmix``); one attention projection Q8_0 (dequantized)."""
    model = _hf_model("qwen3_moe", hidden_size=256, intermediate_size=128, moe_intermediate_size=256, head_dim=64,
                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})

    def types(tensors):
        t = {n: "Q4_K" for n in tensors if n.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight"))}
        t["blk.1.ffn_down_exps.weight"] = "Q6_K"
        t["blk.2.ffn_down_exps.weight"] = "Q4_K"
        t["blk.1.attn_q.weight"] = "Q8_0"
        return t

    hf_dir, path, where = _to_gguf(model, tmp_path, "qwen3moe", types)
    _check(tmp_path, hf_dir, path, where, "qwen3moe",
           ("Q4_K (ggml blocks)", "Q4_K|Q6_K (ggml blocks, a kind per expert)"))


def test_mixtral_llama_q8_0(tmp_path):
    """``llama`` with experts (Mixtral): Q8_0 experts kept as blocks, Q/K rows permuted."""
    model = _hf_model("mixtral", hidden_size=64, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf_dir, path, where = _to_gguf(model, tmp_path, "llama",
                                   lambda tensors: {n: "Q8_0" for n in tensors if "_exps" in n})
    _check(tmp_path, hf_dir, path, where, "llama", ("Q8_0 (ggml blocks)", "Q8_0 (ggml blocks)"))


@pytest.mark.parametrize("family,arch", [("qwen2_moe", "qwen2moe"), ("olmoe", "olmoe")])
def test_qwen2moe_and_olmoe_q8_0(tmp_path, family, arch):
    """The other MoE layouts: Qwen2-MoE (shared expert + its sigmoid gate, qkv biases) and OLMoE (whole-projection
    q/k norms), Q8_0 experts and shared expert."""
    extra = dict(shared_expert_intermediate_size=64, moe_intermediate_size=32) if family == "qwen2_moe" else {}
    model = _hf_model(family, hidden_size=64, intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **extra)
    hf_dir, path, where = _to_gguf(model, tmp_path, arch, lambda tensors: {
        n: "Q8_0" for n in tensors if "_exps" in n or n.endswith(("ffn_gate_shexp.weight", "ffn_down_shexp.weight"))})
    _check(tmp_path, hf_dir, path, where, arch, ("Q8_0 (ggml blocks)", "Q8_0 (ggml blocks)"))


def test_float_experts_stay_plain(tmp_path):
    """F32 expert stacks load as plain weights."""
    model = _hf_model("mixtral", hidden_size=64, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf_dir, path, where = _to_gguf(model, tmp_path, "llama", lambda tensors: {})
    assert "quantization_config" not in gguf_config(path)
    loaded = load_model(path)
    assert not isinstance(loaded.executor.layers[0].gate, QuantTensor)
    ids = token_ids(12, VOCAB, seed=5)
    with torch.no_grad():
        ref = model(input_ids=ids[None]).logits[0]
    assert (full_logits(loaded.model, ids) - ref).abs().max().item() <= 1e-4
