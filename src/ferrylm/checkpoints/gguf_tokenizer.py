"""The tokenizer and chat template of a GGUF file, built from its ``tokenizer.*`` metadata.

One mechanism for every architecture: the file's ``tokenizer.*`` metadata as our own header reader parsed it
(``checkpoints/gguf_reader.read_gguf``, parsed once per process: resolving the model read it already), renamed by
transformers' ``GGUF_TOKENIZER_MAPPING`` into the fields its ``convert_gguf_tokenizer`` takes (the vocabulary,
merges, token types, special token ids, ``add_bos_token``, ``tokenizer.chat_template``), which builds the fast
tokenizer from ``tokenizer.ggml.model`` and sets the split regex of ``tokenizer.ggml.pre``, whatever
``general.architecture`` says. (transformers' own ``get_gguf_tokenizer`` parses the header again in Python and
imports torch: seconds of a server's start.) Pre-tokenizer types the library does not know:

- ``smollm`` / ``starcoder`` / ``refact`` / ``codeshell`` (llama.cpp's ``llama-vocab.cpp``: every ``\\p{N}``
  isolated, then the GPT-2 split): the digit split is put in front of the library's byte-level pre-tokenizer here;
- any other: the library's default split for the vocabulary type is kept, and a warning names the type.

The library's byte-level builder adds GPT-2's ``<|endoftext|>`` to a vocabulary that lacks it (an id past the
model's embedding rows): added tokens outside the file's ``tokenizer.ggml.tokens`` are dropped.

A transformers without that converter (older releases) falls back to
``AutoTokenizer.from_pretrained(gguf_file=)``, which only knows the architectures it can load.

The built tokenizer is kept as ``<cache root>/gguf-tokenizers/<key>.json`` (the key hashes the file's path, size and
mtime and the library versions): a later start reads it instead of importing and running the converter.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from ferrylm.errors import ModelLoadError

log = logging.getLogger(__name__)

#: ``tokenizer.ggml.pre`` values whose llama.cpp pre-tokenizer isolates every digit before the GPT-2 split
DIGITS_THEN_GPT2 = frozenset({"smollm", "starcoder", "refact", "codeshell"})
_DEFAULT_MAX_LEN = 2048
CACHE_FORMAT = 2   # bump when what the cache holds changes


def _library_converter() -> tuple[Any, dict] | None:
    """transformers' ``(convert_gguf_tokenizer, GGUF_TOKENIZER_MAPPING)``, or None when it lacks them."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (GGUF_TOKENIZER_MAPPING,
                                                                            convert_gguf_tokenizer)
    except ImportError:
        return None
    return convert_gguf_tokenizer, GGUF_TOKENIZER_MAPPING


#: tokenizer_config names of the special tokens -> their ``tokenizer.ggml.*`` id keys
_SPECIAL_TOKEN_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                      "pad_token": "padding_token_id"}


def tokenizer_fields(meta: dict[str, Any], mapping: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tokenizer fields, tokenizer_config kwargs)`` of a GGUF's metadata ``meta``: ``mapping`` (the library's
    ``GGUF_TOKENIZER_MAPPING``: group -> ``tokenizer.`` key suffix -> field) renames the keys; numeric arrays
    become lists; the special tokens are named by their ids; ``add_bos_token`` follows llama.cpp (on for a
    sentencepiece ``llama`` vocabulary that does not say, off for ``gemma4``, whose chat template writes it)."""
    groups = {group: {name: _plain(meta[f"tokenizer.{key}"]) for key, name in renames.items()
                      if f"tokenizer.{key}" in meta} for group, renames in mapping.items()}
    fields, config = groups["tokenizer"], groups["tokenizer_config"]
    if fields.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)
    elif fields.get("tokenizer_type") == "gemma4":
        config["add_bos_token"] = False
    tokens = fields.get("tokens") or []
    for name, key in _SPECIAL_TOKEN_IDS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        config[name] = tokens[int(token_id)] if token_id is not None else None
    return fields, config


def _plain(value: Any) -> Any:
    """A metadata value as the library's fields hold it (a numpy array or a long string array as a list)."""
    import numpy as np

    from ferrylm.checkpoints.gguf_reader import LazyStrings

    return value.tolist() if isinstance(value, (np.ndarray, LazyStrings)) else value


def _split_digits(backend: Any) -> None:
    """Put llama.cpp's digit isolation in front of ``backend``'s byte-level pre-tokenizer."""
    from tokenizers import Regex, pre_tokenizers

    digits = pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated")
    backend.pre_tokenizer = pre_tokenizers.Sequence([digits, backend.pre_tokenizer])


def _within_vocab(backend: Any, n_tokens: int) -> Any:
    """``backend`` without the added tokens whose id is ``n_tokens`` or more (not in the file's vocabulary)."""
    import json

    from tokenizers import Tokenizer

    spec = json.loads(backend.to_str())
    extra = [a for a in spec["added_tokens"] if a["id"] >= n_tokens]
    if not extra:
        return backend
    spec["added_tokens"] = [a for a in spec["added_tokens"] if a["id"] < n_tokens]
    for a in extra:
        spec["model"]["vocab"].pop(a["content"], None)
    return Tokenizer.from_str(json.dumps(spec))


def _from_metadata(path: Path, library: tuple[Any, dict]) -> tuple[Any, dict[str, Any], str | None]:
    """``(tokenizers.Tokenizer, tokenizer_config kwargs, warning or None)`` of the GGUF ``path``, built by the
    library's converter."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    from ferrylm.checkpoints.gguf_reader import read_gguf

    convert, mapping = library
    g = read_gguf(path)
    tok_dict, config = tokenizer_fields(g.metadata, mapping)
    if not tok_dict.get("tokens"):
        raise ModelLoadError(f"{path}: the GGUF has no tokenizer (tokenizer.ggml.tokens missing)")
    backend, extra = convert(g.get("general.architecture"), tok_dict)
    backend = _within_vocab(backend, len(tok_dict["tokens"]))
    pre, warning = tok_dict.get("pre_tokenizer_type"), None
    if tok_dict.get("tokenizer_type") == "gpt2" and pre in DIGITS_THEN_GPT2:
        _split_digits(backend)
    elif pre not in (None, "default", "gpt-2", "gpt2") and pre not in GGUF_PRE_TOKENIZER_SPLITS:
        warning = (f"{path.name}: tokenizer.ggml.pre {pre!r} is not known to transformers' GGUF reader; text is "
                   f"split with the default rule of tokenizer {tok_dict.get('tokenizer_type')!r}")
    return backend, {**config, **extra}, warning


def _cache_file(path: Path) -> Path:
    """Where the tokenizer built from ``path`` is kept: the key hashes its real path, size, mtime and the versions
    of the libraries that build it."""
    from importlib.metadata import version

    from ferrylm.cachedir import cache_root

    st = path.stat()
    key = json.dumps([CACHE_FORMAT, str(path.resolve()), st.st_size, st.st_mtime_ns, version("transformers"),
                      version("tokenizers")])
    return cache_root() / "gguf-tokenizers" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def _cached(cache: Path) -> tuple[Any, dict[str, Any], str | None] | None:
    """What :func:`_from_metadata` returned for the same file, read back from ``cache`` (its first line is the
    SHA-256 of the rest); None when absent, cut, altered or of another shape."""
    from tokenizers import Tokenizer

    try:
        digest, _, text = cache.read_text().partition("\n")
        if hashlib.sha256(text.encode()).hexdigest() != digest:
            return None
        data = json.loads(text)
        config, warning = data["config"], data["warning"]
        if not isinstance(config, dict) or not isinstance(warning, (str, type(None))):
            return None
        return Tokenizer.from_str(data["tokenizer"]), config, warning
    except Exception:  # noqa: BLE001 - a missing or foreign cache file is rebuilt
        return None


def _keep(cache: Path, backend: Any, config: dict[str, Any], warning: str | None) -> None:
    """Write ``cache`` atomically; a cache that cannot be written (read-only home, full disk) is skipped."""
    try:
        text = json.dumps({"tokenizer": backend.to_str(), "config": config, "warning": warning})
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
        tmp.write_text(f"{hashlib.sha256(text.encode()).hexdigest()}\n{text}")
        os.replace(tmp, cache)
    except (OSError, TypeError, ValueError) as e:
        log.debug("tokenizer cache %s not written: %s", cache, e)


def _assemble(path: Path, backend: Any, config: dict[str, Any], warning: str | None) -> Any:
    """The ``PreTrainedTokenizerFast`` over ``backend`` with ``config`` (tokenizer_config kwargs); logs ``warning``."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False,
                                 model_max_length=_max_len(path), **config)
    if warning:
        log.warning("%s", warning)
    return hf


def _built(path: Path) -> Any:
    """The tokenizer of ``path`` from the tokenizer cache, else built from the metadata (then cached)."""
    cache = _cache_file(path)
    got = _cached(cache)
    if got is not None:
        try:
            return _assemble(path, *got)
        except Exception as e:  # noqa: BLE001 - an entry that does not assemble is rebuilt from the file
            log.warning("the cached tokenizer %s does not load (%s); building it again from the GGUF", cache, e)
    library = _library_converter()
    if library is None:
        from transformers import AutoTokenizer   # NOTE: here only: transformers' auto classes import torch

        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    got = _from_metadata(path, library)
    hf = _assemble(path, *got)
    _keep(cache, *got)
    return hf


def gguf_tokenizer(path: str | Path) -> Any:
    """A ``transformers.PreTrainedTokenizerFast`` built from the GGUF file ``path``'s metadata (or read from the
    tokenizer cache, module docstring): its special tokens, ``add_bos_token``, chat template
    (``tokenizer.chat_template``) and ``model_max_length`` (``<arch>.context_length``, else 2048).

    Raises:
        ModelLoadError: the file has no tokenizer, or the library cannot build it (the message says why).
    """
    path = Path(path)
    try:
        hf = _built(path)
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure means the same thing to the user
        raise ModelLoadError(f"{path}: cannot build its tokenizer: {e}") from None
    hf.name_or_path = str(path)
    return hf


def _max_len(path: Path) -> int:
    from ferrylm.checkpoints.gguf_reader import read_gguf

    g = read_gguf(path)
    return int(g.get(f"{g.get('general.architecture')}.context_length", 0) or 0) or _DEFAULT_MAX_LEN
