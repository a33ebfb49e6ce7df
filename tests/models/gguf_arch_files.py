"""Tiny GGUFs of the MoE architectures written from a transformers checkpoint as llama.cpp's
``convert_hf_to_gguf.py`` writes them: names by gguf-py's own ``TensorNameMap`` (HF -> GGUF, the other direction
from ferrylm's tables), routed experts stacked ``[E, N, K]``, the metadata its ``set_gguf_parameters`` writes, and
per family the value changes its converter makes: DeepSeek's ``kv_b_proj`` split into ``k_b`` (transposed) and
``v_b``; gpt-oss's fused, transposed, interleaved experts split; Qwen3-Next's ``in_proj_qkvz`` regrouped into
``attn_qkv`` + ``attn_gate``, its norms stored as ``1 + w``, ``A_log`` as ``-exp(A_log)``, the conv squeezed;
Qwen3.5's value heads reordered from grouped to tiled.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from gguf import GGUFWriter
from safetensors.torch import load_file, save_file
from tests.models.gguf_moe_files import CHAT_TEMPLATE, TYPES, byte_vocab, encode
from tests.models.hf_checkpoints import _COMMON, CASES, CONFIG_CLASSES, _randomize_

VOCAB = len(byte_vocab()[0])
GGUF_ARCH = {"glm4_moe": "GLM4_MOE", "deepseek_v3": "DEEPSEEK2", "gpt_oss": "GPT_OSS", "minimax_m2": "MINIMAXM2",
             "qwen3_next": "QWEN3NEXT", "qwen3_5_moe": "QWEN35MOE"}


def build_hf(case: str, path: Path, seed: int = 7, **overrides) -> Path:
    """The tiny random checkpoint of ``CASES[case]`` (vocabulary: the GGUF test tokenizer's) saved in ``path``."""
    family, kw = CASES[case]
    cfg = getattr(transformers, CONFIG_CLASSES[family])(**{**_COMMON, **kw, "vocab_size": VOCAB,
                                                           "bos_token_id": VOCAB - 2, "eos_token_id": VOCAB - 1,
                                                           **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    _randomize_(model, seed)
    model.eval().save_pretrained(path)
    return path


# --------------------------------------------------------------------------------------------------------------
# tensors
# --------------------------------------------------------------------------------------------------------------

def _stack_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert ``...experts.E.<proj>.weight`` -> one ``...experts.<proj>.weight [E, N, K]`` per layer."""
    out, stacks = {}, {}
    for name, t in sd.items():
        p = name.split(".")
        if ".experts." in name and p[5].isdigit():
            stacks.setdefault(".".join(p[:5] + p[6:]), {})[int(p[5])] = t
        else:
            out[name] = t
    out.update({n: torch.stack([per[e] for e in sorted(per)]) for n, per in stacks.items()})
    return out


def _gpt_oss_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``gate_up_proj [E, H, 2I]`` (interleaved) / ``down_proj [E, I, H]`` and their biases -> llama.cpp's split,
    transposed stacks ``{gate,up,down}_proj.{weight,bias}``."""
    out = {}
    for name, t in sd.items():
        if name.endswith("experts.gate_up_proj"):
            w = t.transpose(-1, -2)
            out[name.replace("gate_up_proj", "gate_proj.weight")] = w[:, 0::2]
            out[name.replace("gate_up_proj", "up_proj.weight")] = w[:, 1::2]
        elif name.endswith("experts.gate_up_proj_bias"):
            out[name.replace("gate_up_proj_bias", "gate_proj.bias")] = t[:, 0::2]
            out[name.replace("gate_up_proj_bias", "up_proj.bias")] = t[:, 1::2]
        elif name.endswith("experts.down_proj"):
            out[name + ".weight"] = t.transpose(-1, -2)
        elif name.endswith("experts.down_proj_bias"):
            out[name.replace("down_proj_bias", "down_proj.bias")] = t
        elif name.endswith(".sinks"):
            out[name + ".weight"] = t
        else:
            out[name] = t
    return out


def _split_kv_b(sd: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """DeepSeek: ``kv_b_proj [H (N + V), R]`` -> ``k_b_proj [H, R, N]`` (transposed) and ``v_b_proj [H, V, R]``."""
    out = {}
    n, v = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    for name, t in sd.items():
        if name.endswith("kv_b_proj.weight"):
            kv = t.view(cfg["num_attention_heads"], n + v, t.shape[-1])
            out[name.replace("kv_b_proj", "k_b_proj")] = kv[:, :n].transpose(1, 2).contiguous()
            out[name.replace("kv_b_proj", "v_b_proj")] = kv[:, n:].contiguous()
        else:
            out[name] = t
    return out


def _tile_v(t: torch.Tensor, dim: int, nk: int, r: int, d: int) -> torch.Tensor:
    """Value heads grouped by key head ``[nk, r, d]`` -> tiled ``[r, nk, d]`` along ``dim``."""
    shape = list(t.shape)
    x = t.reshape(*shape[:dim], nk, r, d, *shape[dim + 1:])
    return x.transpose(dim, dim + 1).contiguous().reshape(shape)


def _qwen_linear(sd: dict[str, torch.Tensor], cfg: dict, family: str) -> dict[str, torch.Tensor]:
    """Qwen3-Next / Qwen3.5 (module docstring). Returns HF-side names except Qwen3-Next's ``attn_qkv`` /
    ``attn_gate``, given as ``<layer prefix>.@attn_qkv`` / ``@attn_gate`` for :func:`_gguf_names`."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, r = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], nv // nk
    out = {}
    for name, t in sd.items():
        if name.endswith("norm.weight") and "linear_attn.norm" not in name:
            t = t + 1
        if family == "qwen3_5_moe" and ".linear_attn." in name:
            if name.endswith("in_proj_qkv.weight"):
                t = torch.cat([t[:2 * nk * dk], _tile_v(t[2 * nk * dk:], 0, nk, r, dv)])
            elif name.endswith("in_proj_z.weight"):
                t = _tile_v(t, 0, nk, r, dv)
            elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
                t = _tile_v(t, 0, nk, r, 1)
            elif name.endswith("conv1d.weight"):
                t = torch.cat([t[:2 * nk * dk], _tile_v(t[2 * nk * dk:], 0, nk, r, dv)])
            elif name.endswith("out_proj.weight"):
                t = _tile_v(t, 1, nk, r, dv)
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.replace(".dt_bias", ".dt_proj.bias")
        elif name.endswith("conv1d.weight"):
            t = t.squeeze(1)
        if name.endswith("in_proj_qkvz.weight"):
            g = t.view(nk, 2 * dk + 2 * r * dv, -1)
            q, k, v, z = torch.split(g, [dk, dk, r * dv, r * dv], dim=1)
            base = name.removesuffix("linear_attn.in_proj_qkvz.weight")
            out[base + "@attn_qkv"] = torch.cat([x.reshape(-1, t.shape[-1]) for x in (q, k, v)])
            out[base + "@attn_gate"] = z.reshape(-1, t.shape[-1])
            continue
        out[name] = t
    return out


def _gguf_names(sd: dict[str, torch.Tensor], family: str, blocks: int) -> dict[str, torch.Tensor]:
    """HF-side names -> GGUF names by gguf-py's ``TensorNameMap`` of the family's architecture."""
    tmap = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, GGUF_ARCH[family]), blocks)
    out = {}
    for name, t in sd.items():
        if "@" in name:  # already a GGUF kind (Qwen3-Next's regrouped projections)
            base, kind = name.split("@")
            out[f"blk.{base.split('.')[2]}.{kind}.weight"] = t
            continue
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        g = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        assert g is not None, f"gguf-py maps no GGUF name to {name}"
        out[g] = t
    return out


def gguf_tensors(hf_dir: Path, family: str, *, split_kv_b: bool = True, mtp_layers: int = 0
                 ) -> dict[str, torch.Tensor]:
    """The GGUF tensors (name -> float32 tensor, PyTorch order) of the checkpoint in ``hf_dir``; ``mtp_layers``
    extra blocks numbered after the decoder, as llama.cpp writes multi-token-prediction layers (GLM-4.5's nextn)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    sd = {k: v.float() for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    sd = _gpt_oss_experts(sd) if family == "gpt_oss" else _stack_experts(sd)
    if family == "deepseek_v3" and split_kv_b:
        sd = _split_kv_b(sd, cfg)
    if family in ("qwen3_next", "qwen3_5_moe"):
        sd = _qwen_linear(sd, cfg, family)
    layers = cfg["num_hidden_layers"]
    for m in range(layers, layers + mtp_layers):  # a copy of the last layer plus the nextn projections
        g = torch.Generator().manual_seed(m)
        for name, t in list(sd.items()):
            if name.startswith(f"model.layers.{layers - 1}."):
                sd[name.replace(f"layers.{layers - 1}.", f"layers.{m}.")] = torch.randn(t.shape, generator=g)
        h = cfg["hidden_size"]
        sd[f"model.layers.{m}.eh_proj.weight"] = torch.randn(h, 2 * h, generator=g)
        sd[f"model.layers.{m}.enorm.weight"] = torch.ones(h)
    return _gguf_names(sd, family, layers + mtp_layers)


# --------------------------------------------------------------------------------------------------------------
# metadata
# --------------------------------------------------------------------------------------------------------------

def _rope(w: GGUFWriter, cfg: dict) -> None:
    rp = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(cfg.get("rope_theta") or rp["rope_theta"])
    if rp.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        if "beta_fast" in rp:
            w.add_rope_scaling_yarn_beta_fast(rp["beta_fast"])
        if "beta_slow" in rp:
            w.add_rope_scaling_yarn_beta_slow(rp["beta_slow"])


def _partial(cfg: dict) -> float:
    rp = cfg.get("rope_parameters") or {}
    return cfg.get("partial_rotary_factor") or rp.get("partial_rotary_factor") or 1.0


def _metadata(w: GGUFWriter, family: str, cfg: dict, blocks: int, split_kv_b: bool) -> None:
    """What llama.cpp's converter of ``family`` writes (``TextModel`` + the family's ``set_gguf_parameters``)."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or h // heads
    w.add_block_count(blocks)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(h)
    if cfg.get("intermediate_size"):
        w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    _rope(w, cfg)
    w.add_expert_count(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if blocks > cfg["num_hidden_layers"]:
        w.add_nextn_predict_layers(blocks - cfg["num_hidden_layers"])
    if family == "deepseek_v3":
        _deepseek_metadata(w, cfg, split_kv_b)
        return
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if family == "glm4_moe":
        w.add_rope_dimension_count(int(head_dim * _partial(cfg)))
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
    elif family == "gpt_oss":
        w.add_sliding_window(cfg["sliding_window"])
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
    elif family == "minimax_m2":
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
        w.add_rope_dimension_count(cfg["rotary_dim"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    else:  # Qwen3-Next, Qwen3.5
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        w.add_ssm_state_size(cfg["linear_key_head_dim"])
        w.add_ssm_group_count(cfg["linear_num_key_heads"])
        w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
        w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
        interval = cfg.get("full_attention_interval") or cfg["layer_types"].index("full_attention") + 1
        w.add_full_attention_interval(interval)
        w.add_rope_dimension_count(int(head_dim * _partial(cfg)))
        if family == "qwen3_5_moe":
            w.add_rope_dimension_sections([11, 11, 10, 0])


def _deepseek_metadata(w: GGUFWriter, cfg: dict, split_kv_b: bool) -> None:
    """``DeepseekV2Model.set_gguf_parameters``; ``split_kv_b`` False writes the older files' MHA lengths."""
    r, p = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    n, v = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    if split_kv_b:
        w.add_head_count_kv(1)
        w.add_key_length(r + p)
        w.add_value_length(r)
        w.add_key_length_mla(n + p)
        w.add_value_length_mla(v)
    else:
        w.add_head_count_kv(cfg["num_attention_heads"])
        w.add_key_length(n + p)
        w.add_value_length(v)
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("q_lora_rank") is not None:
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(r)
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg["norm_topk_prob"]:
        w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])
    w.add_rope_dimension_count(p)
    rp = cfg.get("rope_parameters") or {}
    if rp.get("mscale_all_dim") is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * rp["mscale_all_dim"])


def write_arch_gguf(hf_dir: Path, path: Path, family: str, types: Callable[[dict], dict] | None = None, *,
                    split_kv_b: bool = True, mtp_layers: int = 0) -> Path:
    """Write the GGUF of the checkpoint in ``hf_dir`` to ``path`` (module docstring); ``types(tensors)`` gives the
    GGUF type of any tensor that is not F32 (``Q8_0``, ``Q4_K``, ``Q6_K``, ``MXFP4``)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = gguf_tensors(hf_dir, family, split_kv_b=split_kv_b, mtp_layers=mtp_layers)
    kinds = types(tensors) if types is not None else {}
    w = GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, GGUF_ARCH[family])])
    _metadata(w, family, cfg, cfg["num_hidden_layers"] + mtp_layers, split_kv_b)
    tokens, merges, ttypes = byte_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(ttypes)
    w.add_token_merges(merges)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_bos_token_id(len(tokens) - 2)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, t in tensors.items():
        qtype = kinds.get(name, "F32")
        w.add_tensor(name, encode(t, qtype), raw_dtype=None if qtype == "F32" else TYPES[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def dequantized_folder(hf_dir: Path, gguf_path: Path, dst: Path, family: str) -> Path:
    """A copy of ``hf_dir`` whose routed experts are the GGUF's, dequantized by gguf-py (the reference for
    quantized experts), in the checkpoint's own layout."""
    reader = gguf.GGUFReader(str(gguf_path))
    deq = {t.name: torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), copy=True)).float()
           for t in reader.tensors if "_exps.weight" in t.name}
    sd = load_file(str(hf_dir / "model.safetensors"))
    for name in list(sd):
        p = name.split(".")
        if ".experts." not in name or "bias" in name:
            continue
        if family == "gpt_oss":  # [E, H, 2I] gate / up interleaved, [E, I, H]
            if name.endswith("gate_up_proj"):
                gu = torch.empty_like(sd[name])
                gu[..., 0::2] = deq[f"blk.{p[2]}.ffn_gate_exps.weight"].transpose(-1, -2)
                gu[..., 1::2] = deq[f"blk.{p[2]}.ffn_up_exps.weight"].transpose(-1, -2)
                sd[name] = gu
            else:
                sd[name] = deq[f"blk.{p[2]}.ffn_down_exps.weight"].transpose(-1, -2).contiguous()
            continue
        proj = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up"}.get(p[6], "down")
        sd[name] = deq[f"blk.{p[2]}.ffn_{proj}_exps.weight"][int(p[5])].contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text((hf_dir / "config.json").read_text())
    return dst
