"""A MoE GGUF served from its file (checkpoints/quant/gguf_file.py): a tiny random qwen3moe GGUF (experts Q4_K gate/up and
Q6_K down as llama.cpp's Q4_K_M has them, attention Q8_0, norms and router F32) resolves to the file itself and
loads with nothing written beside it and only its tokenizer under the cache dir; expert rows hold the file's bytes;
expert values equal gguf-py's dequantize bit for bit; logits equal transformers on the gguf-py-dequantized weights;
the planned layout counts the file's bits per weight; non-expert tensors take the model dtype; the tokenizer and chat
template come from the file; every backend gives the same greedy tokens. A projection whose layers mix types is
repacked (exact)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tests.experts.helpers import exact_options, greedy_trace, options
from tests.models.gguf_moe_files import CHAT_TEMPLATE
from tests.models.hf_checkpoints import token_ids
from tests.models.quant_checkpoints import dense_reference
from tests.models.test_parity import full_logits
from tests.models.test_quant_gguf import VOCAB, _gguf_reference, _hf_model, _to_gguf

from ferrylm.config import ModelConfig
from ferrylm.experts.executor import ExpertLayout
from ferrylm.experts.quantized import QuantTensor
from ferrylm.checkpoints.loader import load_model
from ferrylm.checkpoints.quant import planned_expert_quant
from ferrylm.checkpoints.resolve import resolve_model
from ferrylm.server.text.tokenizer import TextCodec

gguf = pytest.importorskip("gguf")
H, I = 256, 256


def _qwen3moe(tmp_path, down_types):
    """The HF model, its GGUF and the name map; ``down_types[layer]`` is each MoE layer's ffn_down_exps type."""
    model = _hf_model("qwen3_moe", hidden_size=H, intermediate_size=128, moe_intermediate_size=I, head_dim=64,
                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})

    def types(tensors):
        t = {n: "Q4_K" for n in tensors if n.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight"))}
        t.update({f"blk.{n}.ffn_down_exps.weight": ty for n, ty in down_types.items()})
        t.update({n: "Q8_0" for n in tensors if n.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight",
                                                            "attn_output.weight", "token_embd.weight"))})
        return t

    return _to_gguf(model, tmp_path, "qwen3moe", types)


def _listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_qwen3moe_gguf_is_served_from_its_file(tmp_path, monkeypatch, caplog):
    cache = tmp_path / "cache"
    monkeypatch.setenv("FERRYLM_CACHE_DIR", str(cache))
    hf_dir, path, where = _qwen3moe(tmp_path, {1: "Q6_K", 2: "Q6_K"})
    before = _listing(tmp_path)

    resolved = resolve_model(str(path))
    assert resolved.path == path.resolve() and resolved.source == "gguf" and resolved.has_tokenizer
    cfg = ModelConfig.from_folder(resolved.path)
    quant = planned_expert_quant(cfg.raw)
    assert (quant.gate_up.describe(), quant.down.describe()) == ("Q4_K (ggml blocks)", "Q6_K (ggml blocks)")
    assert quant.gate_up.bits_per_weight(2 * I, H) == 4.5 and quant.down.bits_per_weight(H, I) == 6.5625
    with caplog.at_level("INFO", logger="ferrylm.models"):
        loaded = load_model(resolved.path, moe_backend=exact_options())
    assert "down Q6_K (ggml blocks), 5.19 bits/weight in memory (5.19 in the file)" in caplog.text
    codec = TextCodec.from_pretrained(resolved.path)
    # no copy or conversion of the model: the cache holds only the tokenizer built from the header
    kept = [p for p in _listing(tmp_path) if p.startswith("cache")]
    assert [p for p in _listing(tmp_path) if not p.startswith("cache")] == before
    assert kept[:2] == ["cache", "cache/gguf-tokenizers"] and len(kept) == 3 and kept[2].endswith(".json")

    # the memory plan's layout (planned from the header) is the loaded one, at the file's bits per weight
    le = loaded.executor.layers[1]
    layout = ExpertLayout.of(le)
    assert layout == ExpertLayout(H, I, torch.float32, quant)
    file_bytes = I * H // 256 * 144 * 2 + H * I // 256 * 210
    assert file_bytes <= layout.nbytes < file_bytes + 128

    # expert rows hold the file's bytes, byte for byte
    reader = gguf.GGUFReader(str(path))
    raw = {t.name: torch.from_numpy(np.array(t.data, copy=True)).reshape(-1) for t in reader.tensors}
    rows = torch.zeros(4, layout.numel, dtype=torch.uint8)
    for n in (1, 2):
        lx = loaded.executor.layers[n]
        assert isinstance(lx.gate, QuantTensor) and lx.down.fmt == quant.down
        layout.pack(rows, lx)
        gate, down = I * H // 256 * 144, H * I // 256 * 210
        off = -(-2 * gate // 64) * 64
        for e in range(4):
            assert torch.equal(rows[e, :gate], raw[f"blk.{n}.ffn_gate_exps.weight"][e * gate:(e + 1) * gate])
            assert torch.equal(rows[e, gate:2 * gate], raw[f"blk.{n}.ffn_up_exps.weight"][e * gate:(e + 1) * gate])
            assert torch.equal(rows[e, off:off + down], raw[f"blk.{n}.ffn_down_exps.weight"][e * down:(e + 1) * down])

    # values: experts equal gguf-py's dequantize; logits equal transformers on the dequantized weights
    hf_cfg = json.loads((hf_dir / "config.json").read_text())
    reference = _gguf_reference(path, where, "qwen3moe", hf_cfg)
    for hf, w in reference.items():
        if ".experts." in hf:
            p = hf.split(".")
            lx = loaded.executor.layers[int(p[2])]
            qt = {"gate_proj": lx.gate, "up_proj": lx.up}.get(p[6], lx.down)
            assert torch.equal(qt[int(p[5])].dequantize(torch.float32), w), hf
    ref_model = dense_reference(hf_dir, tmp_path / "dequantized", reference)
    ids = token_ids(20, VOCAB, seed=4)
    with torch.no_grad():
        ref = ref_model(input_ids=ids[None]).logits[0]
    err = (full_logits(loaded.model, ids) - ref).abs().max().item()
    assert err <= 1e-4, err

    # tokenizer and chat template from the metadata
    assert codec.tokenizer.chat_template == CHAT_TEMPLATE and codec.eos_token_ids == (VOCAB - 1,)
    text = "<|im_start|>user\nthe theme, 12 <|im_end|>"
    assert codec.tokenizer.convert_ids_to_tokens(codec.tokenizer.encode(text)) == [
        "<|im_start|>", "u", "s", "e", "r", "Ċ", "t", "he", "Ġt", "he", "m", "e", ",", "Ġ", "1", "2", "Ġ", "<|im_end|>"]
    assert set(codec.special_strings) == {"<|im_start|>", "<|im_end|>"} and codec.vocab_size == VOCAB
    assert codec.render_chat([{"role": "user", "content": "hi there"}]) == "<|im_start|>user\nhi there<|im_end|>\n"

    # every backend: the same greedy tokens
    prompt = token_ids(8, VOCAB, seed=9).tolist()
    want = greedy_trace(loaded.model, prompt, 4)[0]
    for backend in ("resident", "offload", "cpu", "hybrid"):   # resident: the native kernel, the CPU default
        assert greedy_trace(load_model(path, moe_backend=options(backend, 1)).model, prompt, 4)[0] == want, backend


def test_non_expert_tensors_take_the_model_dtype(tmp_path):
    _, path, _ = _qwen3moe(tmp_path, {1: "Q6_K", 2: "Q6_K"})
    loaded = load_model(path, dtype=torch.bfloat16)
    dtypes = {p.dtype for p in loaded.model.parameters()}
    assert dtypes == {torch.bfloat16}, dtypes
    le = loaded.executor.layers[1]
    assert le.gate.dtype == torch.bfloat16 and le.gate.data.dtype == torch.uint8


def test_mixed_down_types_keep_their_blocks(tmp_path):
    """Q6_K in layer 1 and Q4_K in layer 2 (Q4_K_M's mix): one row layout for all layers, so down is ``kmix`` (each
    layer's blocks, padded to Q6_K's row, a tag per expert); values bit for bit, the rows' leading bytes the file's,
    and every backend (the native CPU kernel's kmix path included) gives the resident model's tokens."""
    hf_dir, path, where = _qwen3moe(tmp_path, {1: "Q6_K", 2: "Q4_K"})
    loaded = load_model(path)
    le = loaded.executor.layers[2]
    assert (le.gate.fmt.describe(), le.down.fmt.describe()) == ("Q4_K (ggml blocks)",
                                                                "Q4_K|Q6_K (ggml blocks, a kind per expert)")
    assert planned_expert_quant(ModelConfig.from_folder(path).raw) == ExpertLayout.of(le).quant
    reference = _gguf_reference(path, where, "qwen3moe", json.loads((hf_dir / "config.json").read_text()))
    reader = gguf.GGUFReader(str(path))
    raw = {t.name: torch.from_numpy(np.array(t.data, copy=True)) for t in reader.tensors}
    for n, rb in ((1, H // 256 * 210), (2, H // 256 * 144)):
        down = loaded.executor.layers[n].down
        assert torch.equal(down.data[..., :rb], raw[f"blk.{n}.ffn_down_exps.weight"].view(4, H, rb))
        for e in range(4):
            w = reference[f"model.layers.{n}.mlp.experts.{e}.down_proj.weight"]
            assert torch.equal(down[e].dequantize(torch.float32), w)
    prompt = token_ids(8, VOCAB, seed=9).tolist()
    want = greedy_trace(loaded.model, prompt, 4)[0]
    for backend in ("offload", "cpu", "hybrid"):
        assert greedy_trace(load_model(path, moe_backend=options(backend, 1)).model, prompt, 4)[0] == want, backend


@pytest.mark.parametrize("types", [("Q5_K", "Q6_K"), ("Q4_K", "Q5_K", "Q8_0")])
def test_mixed_projection_formats_repack_exactly(types):
    """K-quant mixes stay blocks (``kmix``); a mix with Q8_0 becomes the unified int8 format with mins, and every
    type repacks into it without changing a value: equal to gguf-py's dequantize."""
    from ferrylm.experts.gguf_blocks import BLOCK_TYPES, fill_random_blocks
    from ferrylm.checkpoints.gguf_reader import GGUFTensor
    from ferrylm.checkpoints.quant.gguf_file import projection_format
    from ferrylm.checkpoints.quant.gguf_moe import _DECODERS, repack, unified_format

    chosen = projection_format(list(types), "down")
    assert chosen.kind == ("int8" if "Q8_0" in types else "kmix")
    fmt = unified_format(set(types))
    assert fmt.kind == "int8" and fmt.mins
    for name in types:
        bt = BLOCK_TYPES[name.lower()]
        raw = torch.empty(2, 8, 512 // bt.elems * bt.nbytes, dtype=torch.uint8)
        fill_random_blocks(raw, name.lower(), generator=torch.Generator().manual_seed(5), std=0.1)
        t = GGUFTensor("blk.0.ffn_down_exps.weight", (2, 8, 512), int(getattr(gguf.GGMLQuantizationType, name)), 0,
                       raw.numel())
        qt = repack(_DECODERS[name][0](raw.numpy().reshape(-1), t), fmt, torch.float32)
        want = torch.from_numpy(np.array(gguf.quants.dequantize(raw.numpy(), getattr(gguf.GGMLQuantizationType, name))))
        assert torch.equal(qt.dequantize(), want), name


def test_truncated_file_and_unread_types_are_named(tmp_path):
    """A GGUF cut short is refused at resolve, naming a tensor; an expert type that is not read (Q4_0) is refused
    naming the types that are, before any weight is loaded."""
    import tests.models.gguf_moe_files as files
    from gguf import GGMLQuantizationType as QT

    from ferrylm.errors import ModelLoadError

    _, path, _ = _qwen3moe(tmp_path / "a", {1: "Q6_K", 2: "Q6_K"})
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="is truncated: tensor .* ends past the end of the file"):
        resolve_model(str(cut))
    cut.write_bytes(path.read_bytes()[:400])   # cut inside the header (metadata / tensor table)
    with pytest.raises(ModelLoadError, match="is truncated: its header runs past the end of the file"):
        resolve_model(str(cut))
    files.TYPES["Q4_0"] = QT.Q4_0
    try:
        _, bad, _ = _qwen3moe(tmp_path / "b", {1: "Q4_0", 2: "Q4_0"})
    finally:
        del files.TYPES["Q4_0"]
    with pytest.raises(ModelLoadError, match=r"down experts have GGUF types \['Q4_0'\]; read are one of Q8_0, "
                                             r"Q4_K, Q5_K, Q6_K, MXFP4 per projection"):
        planned_expert_quant(ModelConfig.from_folder(bad).raw)
    with pytest.raises(ModelLoadError, match=r"GGUF types \['Q4_0'\]"):
        load_model(bad)


def test_model_is_built_on_meta_without_the_compiler_stack():
    """The model is built on ``meta`` with no random initialisation run: torch's meta ``normal_`` (an embedding's
    init) imports its decomposition and compiler stack (``torch._dynamo``, sympy), over a second of every start."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from ferrylm.config import ModelConfig\n"
            "from ferrylm.checkpoints.assemble import build_on_meta\n"
            "from ferrylm.models.registry import get_model_class\n"
            "cfg = ModelConfig.from_dict({'architectures': ['LlamaForCausalLM'], 'hidden_size': 64, "
            "'intermediate_size': 128, 'num_hidden_layers': 2, 'num_attention_heads': 4, 'num_key_value_heads': 2, "
            "'vocab_size': 100})\n"
            "m = build_on_meta(get_model_class(cfg.architecture), cfg, None, torch.device('cpu'))\n"
            "assert {p.device.type for p in m.parameters()} == {'meta'}\n"
            "assert m.model.embed_tokens.weight.shape == (100, 64)\n"
            "assert 'torch._dynamo' not in sys.modules, 'the compiler stack was imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_memory_plan_names_the_weights_read_in_place(tmp_path, monkeypatch):
    """A GGUF served from its file on the CPU: the experts are the file's mapped bytes, which the RSS-measured
    weights row misses; the plan states them beside it."""
    from ferrylm.config import EngineConfig
    from ferrylm.engine.boot import build_engine

    monkeypatch.setenv("FERRYLM_CACHE_DIR", str(tmp_path / "cache"))
    _, path, _ = _qwen3moe(tmp_path, {1: "Q6_K", 2: "Q6_K"})
    eng = build_engine(path, EngineConfig(device="cpu", max_prefill_length=64, max_running_requests=2))
    expert_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors if "_exps." in t.name)
    plan = eng.memory_plan
    assert expert_bytes <= plan.mapped_bytes <= path.stat().st_size + 4096
    assert "read in place from the file" in plan.format_table()
    eng.runner.close()


def test_long_string_arrays_are_read_on_demand(tmp_path, monkeypatch):
    """A vocabulary past LAZY_STRINGS_MIN strings stays bytes until read (its length known without decoding);
    read, it equals gguf-py's strings, and the tokenizer built from it encodes as the eager one does."""
    import ferrylm.checkpoints.gguf_reader as gr

    _, path, _ = _qwen3moe(tmp_path, {1: "Q6_K", 2: "Q6_K"})
    eager = gr._read_gguf_cached(("eager",), path).metadata
    monkeypatch.setattr(gr, "LAZY_STRINGS_MIN", 2)
    lazy = gr._read_gguf_cached(("lazy",), path).metadata
    field = gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"]
    want = [bytes(field.parts[i]).decode() for i in field.data]
    tokens = lazy["tokenizer.ggml.tokens"]
    assert isinstance(tokens, gr.LazyStrings) and tokens._items is None and len(tokens) == len(want)
    assert tokens == want and eager["tokenizer.ggml.tokens"] == want and tokens[3] == want[3]
    from ferrylm.checkpoints.gguf_tokenizer import gguf_tokenizer

    text = "<|im_start|>user\nthe theme, 12 <|im_end|>"
    encoded = []
    for meta in (lazy, eager):
        monkeypatch.setattr(gr, "read_gguf", lambda p, meta=meta: gr.GGUFFile(path, 3, meta))
        encoded.append(gguf_tokenizer(path).convert_ids_to_tokens(gguf_tokenizer(path).encode(text)))
    assert encoded[0] == encoded[1] == [
        "<|im_start|>", "u", "s", "e", "r", "Ċ", "t", "he", "Ġt", "he", "m", "e", ",", "Ġ", "1", "2", "Ġ", "<|im_end|>"]


def test_tensor_parallel_of_a_gguf_is_one_line_before_anything_starts(tmp_path, monkeypatch, capsys):
    """``ferry serve FILE.gguf --tensor-parallel-size 2``: refused in the frontend (exit 2, one line naming the flag
    and the file) before any engine or rank process is spawned."""
    from ferrylm import cli
    from ferrylm.server.process import supervisor

    _, path, _ = _qwen3moe(tmp_path, {1: "Q6_K", 2: "Q6_K"})
    capsys.readouterr()   # the fixture's own progress lines
    monkeypatch.setattr(supervisor.Supervisor, "start", lambda self: pytest.fail("an engine was spawned"))
    assert cli.main(["serve", str(path), "--port", "18477", "--device", "cpu", "--tensor-parallel-size", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("loading ") and err[1:] == [f"ferry serve: --tensor-parallel-size 2: {path.name} is a GGUF file; tensor parallel loads "
                   f"safetensors folders and synthetic models only (for now)"], err
