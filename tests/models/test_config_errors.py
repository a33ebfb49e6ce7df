"""config.json problems are one clear line naming the field or the architecture (issue 26), never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ferrylm.config import ModelConfig
from ferrylm.errors import ModelLoadError, UnsupportedArchitecture

GOOD = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 128, "intermediate_size": 128, "eos_token_id": 1}


def test_good_config_reads() -> None:
    c = ModelConfig.from_dict(GOOD)
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.eos_token_ids) == (64, 4, 4, 16, (1,))


@pytest.mark.parametrize("field,value", [("hidden_size", "abc"), ("hidden_size", 64.5), ("hidden_size", -1),
                                         ("num_hidden_layers", [2]), ("vocab_size", True),
                                         ("num_key_value_heads", "two"), ("rms_norm_eps", "small"),
                                         ("rope_theta", {}), ("eos_token_id", "eos"), ("rope_scaling", 3),
                                         ("tie_word_embeddings", "yes"), ("num_experts", "8")])
def test_wrong_type_names_the_field(field: str, value) -> None:
    with pytest.raises(ModelLoadError) as e:
        ModelConfig.from_dict({**GOOD, field: value})
    assert f"'{field}'" in e.value.message and repr(value) in e.value.message


@pytest.mark.parametrize("archs", [["LlavaForConditionalGeneration"], ["BertModel"]])
def test_unsupported_architecture_is_named_before_missing_fields(archs) -> None:
    # another kind of model: its config has no hidden_size at the top (text_config ...): say the architecture
    with pytest.raises(UnsupportedArchitecture) as e:
        ModelConfig.from_dict({"architectures": archs, "text_config": {"hidden_size": 8}})
    assert archs[0] in e.value.message and "Qwen3MoeForCausalLM" in e.value.message
    assert "hidden_size" not in e.value.message


@pytest.mark.parametrize("archs", ["Qwen3ForCausalLM", [3], None])
def test_bad_architectures_field(archs) -> None:
    with pytest.raises(ModelLoadError) as e:
        ModelConfig.from_dict({**GOOD, "architectures": archs})
    assert "architectures" in e.value.message


@pytest.mark.parametrize("patch,needle", [({"hidden_size": "abc"}, "'hidden_size' must be a positive integer"),
                                          ({"architectures": ["GPT2LMHeadModel"]}, "'GPT2LMHeadModel'")])
def test_ferry_serve_prints_one_line_and_exits_2(tmp_path: Path, patch: dict, needle: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**GOOD, **patch}))
    (tmp_path / "model.safetensors").write_bytes(b"")   # resolve_model wants weights and a tokenizer file;
    (tmp_path / "tokenizer_config.json").write_text("{}")   # the config fails first
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"), OMP_NUM_THREADS="1")
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "ferrylm.cli", "serve", "--model", str(tmp_path), "--port", str(port)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr
