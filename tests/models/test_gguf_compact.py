"""A GGUF on a CPU keeps its non-expert matrices as the file's blocks (checkpoints/quant/gguf_file.py,
models/quant_linear.py): attention, the dense MLP and the lm_head become QuantLinear layers over the mapped bytes, the
token embeddings a QuantEmbedding gathering rows bit for bit as gguf-py dequantizes them; no float copy is made; the
model's greedy tokens equal the float path's (``--moe-cpu-kernel torch``, every weight dequantized) at odd prompt
lengths and step sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from tests.experts.helpers import CPU_QUANT_REL_TOL, greedy_trace, options
from tests.models.hf_checkpoints import token_ids
from tests.models.test_quant_gguf import VOCAB, _hf_model, _to_gguf

from ferrylm.checkpoints.loader import load_model
from ferrylm.models.reference_attention import SequenceCacheAttention
from ferrylm.models.quant_linear import QuantEmbedding, QuantLinear
from ferrylm.models.sizes import non_expert_step_bytes

gguf = pytest.importorskip("gguf")
H = 256
# GGUF types of the non-expert matrices: the block kinds the test writer makes, K-quants where K is a multiple of 256
TYPES = {"attn_q.weight": "Q8_0", "attn_k.weight": "Q6_K", "attn_v.weight": "Q8_0", "attn_output.weight": "Q4_K",
         "ffn_gate.weight": "Q4_K", "ffn_up.weight": "Q6_K", "ffn_down.weight": "Q8_0", "token_embd.weight": "Q8_0",
         "output.weight": "Q6_K"}


# a logit moves by at most ~0.2 here through the 8-bit activations (0.1-0.18 measured over these prompts): a greedy
# choice ahead by more than MARGIN must stay the same
MARGIN = 0.4


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """A tiny qwen3moe GGUF: layer 0 a dense MLP (intermediate 128), layers 1-2 MoE (experts Q4_K / Q6_K)."""
    tmp = tmp_path_factory.mktemp("compact")
    model = _hf_model("qwen3_moe", hidden_size=H, intermediate_size=128, moe_intermediate_size=256, head_dim=64,
                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})

    def types(tensors):
        t = {n: ty for n in tensors for suffix, ty in TYPES.items() if n.endswith(suffix)}
        t.update({n: "Q4_K" if "down" not in n else "Q6_K" for n in tensors if "_exps." in n})
        return t

    _, path, _ = _to_gguf(model, tmp, "qwen3moe", types)
    return path


def _raw(path) -> dict[str, np.ndarray]:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def test_non_expert_matrices_are_the_files_blocks(gguf_file):
    loaded = load_model(gguf_file, dtype=torch.bfloat16)
    model, raw = loaded.model, _raw(gguf_file)
    layers = model.model.layers
    compact = {f"blk.{i}.{g}.weight": getattr(layers[i].self_attn, hf) for i in range(3) for g, hf in (
        ("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj"))}
    compact.update({f"blk.0.ffn_{p}.weight": getattr(layers[0].mlp, f"{p}_proj") for p in ("gate", "up", "down")})
    compact["output.weight"] = model.lm_head
    for name, layer in compact.items():
        assert isinstance(layer, QuantLinear), name
        assert layer.weight.kinds == (raw[name].tensor_type.name.lower(),), name
        seg = layer.weight.segments[0]
        assert torch.equal(seg.reshape(-1), torch.from_numpy(np.array(raw[name].data).view(np.uint8).reshape(-1)))
    # no float copy: the state dict holds norms, routers and biases only; q|k|v fused over the three mapped tensors
    names = set(model.state_dict())
    assert not any(n.endswith(("proj.weight", "embed_tokens.weight", "lm_head.weight")) for n in names), names
    attn = layers[1].self_attn
    fused = attn._qkv.__self__.weight
    assert [s.data_ptr() for s in fused.segments] == [p.weight.segments[0].data_ptr() for p in
                                                     (attn.q_proj, attn.k_proj, attn.v_proj)]
    # a decode step reads the compact layers' blocks (the lm_head's included) and the parameters, not the table
    blocks = sum(m.weight.nbytes for m in model.modules() if isinstance(m, QuantLinear))
    assert blocks >= raw["output.weight"].n_bytes + raw["blk.0.attn_q.weight"].n_bytes
    assert non_expert_step_bytes(model) == blocks + sum(p.numel() * p.element_size() for p in model.parameters())
    # embedding rows: gguf-py's dequantization, cast to the model dtype
    emb = model.model.embed_tokens
    assert isinstance(emb, QuantEmbedding)
    ids = torch.tensor([[3, 250, 3], [0, 17, VOCAB - 1]])
    table = torch.from_numpy(gguf.quants.dequantize(raw["token_embd.weight"].data, raw["token_embd.weight"].tensor_type))
    got = emb(ids)
    assert got.dtype == torch.bfloat16 and torch.equal(got, table[ids].to(torch.bfloat16))


def _forced(model, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """Logits ``[V]`` after ``prompt`` (prefilled in chunks of 7 and the rest: odd step sizes) and after each of
    ``tokens`` but the last, fed one per step."""
    cache, out = SequenceCacheAttention(), []
    steps = [s for s in (prompt[:7], prompt[7:]) if s] + [[t] for t in tokens[:-1]]
    pos = 0
    with torch.inference_mode():
        for ids in steps:
            hidden = model(torch.tensor(ids), torch.arange(pos, pos + len(ids)), cache)
            pos += len(ids)
            if pos >= len(prompt):
                out.append(model.compute_logits(hidden[-1:])[0])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_equal_the_float_path(gguf_file, dtype):
    """The compact model (every matrix on the native kernels, 8-bit activations) against the float one
    (``--moe-cpu-kernel torch``) on the float model's greedy continuation of prompts of odd lengths: the logits of
    the steps within the activations' rounding (but for a step or two where a router's near tie picks another expert
    of this tiny random model), and the same greedy token wherever the float model's choice wins by more than that
    rounding moves a logit (its near ties may flip, as in any engine with 8-bit activations)."""
    compact = load_model(gguf_file, dtype=dtype).model
    plain = load_model(gguf_file, dtype=dtype, moe_backend=options("resident", None, cpu_kernel="torch")).model
    assert isinstance(compact.lm_head, QuantLinear) and type(plain.lm_head) is nn.Linear
    rels, decided = [], 0
    for n, seed in ((9, 1), (13, 2), (1, 3)):
        prompt = token_ids(n, VOCAB, seed=seed).tolist()
        tokens, _ = greedy_trace(plain, prompt, 8)
        for got, want, tok in zip(_forced(compact, prompt, tokens), _forced(plain, prompt, tokens), tokens):
            assert int(want.argmax()) == tok
            rels.append(((got.double() - want.double()).norm() / want.double().norm()).item())
            top2 = torch.topk(want.double(), 2).values
            if top2[0] - top2[1] > MARGIN:
                decided += 1
                assert int(got.argmax()) == tok, (n, tok)
    # typical steps within the 8-bit rounding (the K-quants' activations are ggml's Q8_K, a scale per 256 inputs: the
    # whole hidden width of this tiny model), nearly all within twice that; bfloat16 adds its own rounding
    tol = CPU_QUANT_REL_TOL if dtype == torch.float32 else 2 * CPU_QUANT_REL_TOL
    assert sorted(rels)[len(rels) // 2] < tol and sum(r < 2 * tol for r in rels) >= len(rels) - 2, rels
    assert decided >= 12, decided  # of 24 steps


def test_torch_kernel_dequantizes_everything(gguf_file):
    """``--moe-cpu-kernel torch`` (or no compiler): no compact layer, every weight a float parameter."""
    model = load_model(gguf_file, moe_backend=options("resident", None, cpu_kernel="torch")).model
    assert not any(isinstance(m, (QuantLinear, QuantEmbedding)) for m in model.modules())
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
