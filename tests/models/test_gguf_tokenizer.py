"""The tokenizer and chat template of a GGUF come from its metadata whatever its architecture: a GGUF of each
architecture transformers cannot load (qwen3next, qwen35moe, glm4moe, deepseek2) carrying the real Qwen3
tokenizer's metadata, as llama.cpp's converter writes it (``gpt2`` vocabulary, ``qwen2`` pre-tokenizer), encodes
text exactly as the original tokenizer does, and the server renders chats with ``tokenizer.chat_template``."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from gguf import GGUFWriter

from ferrylm.checkpoints.gguf_tokenizer import gguf_tokenizer
from ferrylm.server.text.tokenizer import TextCodec

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = ROOT.parent / "shared" / "data" / "qwen3-tokenizer"
ARCHS = ("qwen3next", "qwen35moe", "glm4moe", "deepseek2")
TEXTS = ("Hello world! 12345 apples cost $3.50.", "  two spaces\n\n\tthen tabs; don't I'll WE'RE",
         "ünïcödé 漢字とかな 🙂 <think>x</think>", "<|im_start|>user\nhi<|im_end|>")
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}]
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4  # tokenizer.ggml.token_type values


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    """A copy of the real Qwen3 tokenizer folder (skips when the shared test data is absent)."""
    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        pytest.skip(f"the real Qwen3 tokenizer is absent: {TOKENIZER_DIR}")
    folder = tmp_path_factory.mktemp("qwen3-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER_DIR / name, folder / name)
    return folder


def write_tokenizer_gguf(folder: Path, path: Path, arch: str) -> Path:
    """A GGUF of ``arch`` holding only ``folder``'s tokenizer as llama.cpp's converter writes its metadata."""
    tok = json.loads((folder / "tokenizer.json").read_text())
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    ids = dict(tok["model"]["vocab"])
    kinds = dict.fromkeys(ids.values(), _NORMAL)
    for a in tok["added_tokens"]:
        ids[a["content"]] = a["id"]
        kinds[a["id"]] = _CONTROL if a["special"] else _USER_DEFINED
    tokens = [""] * (max(ids.values()) + 1)
    for t, i in ids.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w = GGUFWriter(str(path), arch)
    w.add_context_length(4096)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([kinds[i] for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_eos_token_id(ids[cfg["eos_token"]])
    w.add_pad_token_id(ids[cfg["pad_token"]])
    w.add_add_bos_token(False)
    w.add_chat_template(cfg["chat_template"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_and_template_from_the_file(qwen3, tmp_path, arch):
    from transformers import AutoTokenizer

    pytest.importorskip("transformers.integrations.gguf", reason="transformers without its GGUF tokenizer reader")
    path = write_tokenizer_gguf(qwen3, tmp_path / f"{arch}.gguf", arch)
    ref = AutoTokenizer.from_pretrained(str(qwen3))
    tok = gguf_tokenizer(path)
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text), text
    assert tok.eos_token == "<|im_end|>" and tok.model_max_length == 4096
    codec = TextCodec.from_pretrained(path)
    want = ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert codec.chat_template == ref.chat_template
    assert codec.render_chat(CHAT) == want and "<|im_start|>assistant\n" in want
    assert codec.apply_chat_template(CHAT)[:1] == [ref.convert_tokens_to_ids("<|im_start|>")]


def test_gguf_tokenizer_loads_without_torch(qwen3, tmp_path):
    """The frontend builds a GGUF's tokenizer from the header it already parsed, without importing torch (which
    transformers' own GGUF reader imports: seconds of every ``ferry serve FILE.gguf`` start)."""
    import subprocess
    import sys

    path = write_tokenizer_gguf(qwen3, tmp_path / "qwen3.gguf", "qwen3moe")
    code = ("import sys\nfrom ferrylm.server.text.tokenizer import TextCodec\n"
            f"c = TextCodec.from_pretrained({str(path)!r})\n"
            "assert c.encode('Hello world') and c.has_chat_template\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_second_start_reads_the_tokenizer_cache(qwen3, tmp_path, monkeypatch):
    """The built tokenizer is kept in the cache: a second load of the same file does not run the converter and
    encodes alike; an entry cut, altered (its digest differs) or of another shape is rebuilt from the file; a file
    changed in place gets a new entry."""
    from ferrylm.checkpoints import gguf_tokenizer as gt

    monkeypatch.setenv("FERRYLM_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tokenizer_gguf(qwen3, tmp_path / "q.gguf", "qwen3moe")
    first = gguf_tokenizer(path)
    entries = list((tmp_path / "cache" / "gguf-tokenizers").glob("*.json"))
    assert len(entries) == 1
    built = gt._library_converter
    monkeypatch.setattr(gt, "_library_converter", lambda: pytest.fail("the converter ran on a cached file"))
    second = gguf_tokenizer(path)
    for text in TEXTS:
        assert second.encode(text) == first.encode(text), text
    assert (second.eos_token, second.chat_template, second.model_max_length) == \
        (first.eos_token, first.chat_template, first.model_max_length)
    monkeypatch.setattr(gt, "_library_converter", built)
    digest, _, text = entries[0].read_text().partition("\n")
    kept = json.loads(text)

    def signed(data: dict) -> str:   # an entry altered with a matching digest: it must still assemble
        body = json.dumps(data)
        return f"{hashlib.sha256(body.encode()).hexdigest()}\n{body}"

    bad_entries = (digest + "\n" + text[:1000],                               # cut
                   digest + "\n" + text.replace("<|im_end|>", "<|im_end|>x"),  # altered: the digest differs
                   signed({**kept, "config": [1]}), signed({"tokenizer": 5}),
                   signed({**kept, "config": {**kept["config"], "eos_token": 7}}))
    for bad in bad_entries:
        entries[0].write_text(bad)                                  # rebuilt from the file, not an error
        tok = gguf_tokenizer(path)
        assert tok.encode(TEXTS[0]) == first.encode(TEXTS[0]) and tok.eos_token == first.eos_token
        assert entries[0].read_text().partition("\n")[0] == digest
    os.utime(path, ns=(1, 1))
    gguf_tokenizer(path)
    assert len(list(entries[0].parent.glob("*.json"))) == 2
