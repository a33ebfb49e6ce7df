"""A gpt-oss tokenizer folder for tests, built without a download: o200k_base's vocabulary is the
``o200k_base.tiktoken`` file the ``litellm`` package ships (a dev dependency; found by its SHA-256, the one
openai-harmony checks), turned into a Hugging Face byte-level BPE (``tokenizer.json``: the merges recovered from the
ranks, o200k's split pattern) with harmony's special tokens at ids 199998 .. 201087, as gpt-oss's own tokenizer has
them."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
from pathlib import Path

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
VOCAB_SIZE = 201088
SPECIALS = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
            200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>"}
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])


def o200k_file() -> Path | None:
    """The o200k_base vocabulary file litellm ships, or None when litellm (or the file) is absent."""
    spec = importlib.util.find_spec("litellm")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0]) / "litellm_core_utils" / "tokenizers"
    for f in sorted(folder.glob("*")) if folder.is_dir() else []:
        if f.is_file() and f.stat().st_size > 3_000_000 and hashlib.sha256(f.read_bytes()).hexdigest() == O200K_SHA256:
            return f
    return None


def _ranks(path: Path) -> list[bytes]:
    out = []
    for rank, line in enumerate(path.read_bytes().splitlines()):
        b64, r = line.split()
        assert int(r) == rank
        out.append(base64.b64decode(b64))
    return out


def _merges(tokens: list[bytes]) -> list[tuple[bytes, bytes]]:
    """The merge of each multi-byte token: BPE of its bytes with the merges of lower rank leaves two parts."""
    rank = {t: i for i, t in enumerate(tokens)}
    merges = []
    for r, tok in enumerate(tokens):
        if len(tok) < 2:
            continue
        parts = [bytes([c]) for c in tok]
        while len(parts) > 2:
            best = min(((rank.get(parts[i] + parts[i + 1], r), i) for i in range(len(parts) - 1)))
            if best[0] >= r:
                break
            i = best[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        assert len(parts) == 2, (tok, parts)
        merges.append((parts[0], parts[1]))
    return merges


def build_harmony_tokenizer(folder: Path) -> Path:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` of a gpt-oss tokenizer into ``folder``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    from ferrylm.server.text.tokenizer import _bytes_to_unicode

    src = o200k_file()
    assert src is not None, "o200k_base.tiktoken not found in the litellm package"
    tokens = _ranks(src)
    chars = _bytes_to_unicode()

    def piece(b: bytes) -> str:
        return "".join(chars[c] for c in b)

    tok = Tokenizer(models.BPE(vocab={piece(t): i for i, t in enumerate(tokens)},
                               merges=[(piece(a), piece(b)) for a, b in _merges(tokens)], ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(SPECIALS.get(i, f"<|reserved_{i}|>"), special=True, normalized=False)
                            for i in range(len(tokens), VOCAB_SIZE)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False, "model_max_length": 131072}))
    return folder
