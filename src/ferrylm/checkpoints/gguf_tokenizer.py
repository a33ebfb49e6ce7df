"""The tokenizer and chat template of a GGUF file, built in memory from its ``tokenizer.*`` metadata.

One mechanism for every architecture: transformers' tokenizer-only GGUF reader
(``transformers.integrations.gguf``: ``get_gguf_tokenizer`` reads the vocabulary, merges, token types, special
token ids, ``add_bos_token`` and ``tokenizer.chat_template``; ``convert_gguf_tokenizer`` builds the fast tokenizer
from ``tokenizer.ggml.model`` and sets the split regex of ``tokenizer.ggml.pre``), whatever
``general.architecture`` says. Pre-tokenizer types the library does not know:

- ``smollm`` / ``starcoder`` / ``refact`` / ``codeshell`` (llama.cpp's ``llama-vocab.cpp``: every ``\\p{N}``
  isolated, then the GPT-2 split): the digit split is put in front of the library's byte-level pre-tokenizer here;
- any other: the library's default split for the vocabulary type is kept, and a warning names the type.

The library's byte-level builder adds GPT-2's ``<|endoftext|>`` to a vocabulary that lacks it (an id past the
model's embedding rows): added tokens outside the file's ``tokenizer.ggml.tokens`` are dropped.

A transformers without that reader (older releases) falls back to
``AutoTokenizer.from_pretrained(gguf_file=)``, which only knows the architectures it can load.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ferrylm.errors import ModelLoadError

log = logging.getLogger(__name__)

#: ``tokenizer.ggml.pre`` values whose llama.cpp pre-tokenizer isolates every digit before the GPT-2 split
DIGITS_THEN_GPT2 = frozenset({"smollm", "starcoder", "refact", "codeshell"})
_DEFAULT_MAX_LEN = 2048


def _library_reader() -> tuple[Any, Any] | None:
    """transformers' ``(get_gguf_tokenizer, convert_gguf_tokenizer)``, or None when it lacks them."""
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError:
        return None
    return get_gguf_tokenizer, convert_gguf_tokenizer


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


def _from_metadata(path: Path, reader: tuple[Any, Any]) -> tuple[Any, dict[str, Any]]:
    """``(tokenizers.Tokenizer, tokenizer_config kwargs)`` of the GGUF ``path`` by the library's reader."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    get_tokenizer, convert = reader
    arch, tok_dict, config = get_tokenizer(str(path))
    if not tok_dict.get("tokens"):
        raise ModelLoadError(f"{path}: the GGUF has no tokenizer (tokenizer.ggml.tokens missing)")
    backend, extra = convert(arch, tok_dict)
    backend = _within_vocab(backend, len(tok_dict["tokens"]))
    pre = tok_dict.get("pre_tokenizer_type")
    if tok_dict.get("tokenizer_type") == "gpt2" and pre in DIGITS_THEN_GPT2:
        _split_digits(backend)
    elif pre not in (None, "default", "gpt-2", "gpt2") and pre not in GGUF_PRE_TOKENIZER_SPLITS:
        log.warning("%s: tokenizer.ggml.pre %r is not known to transformers' GGUF reader; text is split with the "
                    "default rule of tokenizer %r", path.name, pre, tok_dict.get("tokenizer_type"))
    return backend, {**config, **extra}


def gguf_tokenizer(path: str | Path) -> Any:
    """A ``transformers.PreTrainedTokenizerFast`` built from the GGUF file ``path``'s metadata (nothing written):
    its special tokens, ``add_bos_token``, chat template (``tokenizer.chat_template``) and ``model_max_length``
    (``<arch>.context_length``, else 2048).

    Raises:
        ModelLoadError: the file has no tokenizer, or the library cannot build it (the message says why).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    reader = _library_reader()
    try:
        if reader is None:
            hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        else:
            backend, config = _from_metadata(path, reader)
            hf = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False,
                                         model_max_length=_max_len(path), **config)
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
