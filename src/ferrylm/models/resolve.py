"""``--model`` resolution: a built-in name, a local HF folder or a local ``.gguf`` file -> one HF folder.

Nothing is ever downloaded: a hub id such as ``HuggingFaceTB/SmolLM2-135M-Instruct`` is refused with the list of
built-in names. Every refusal is a :class:`ModelLoadError` with one line naming what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ferrylm.errors import ModelLoadError

SYNTHETIC_PREFIX = "synthetic:"


@dataclass(frozen=True)
class ResolvedModel:
    """What ``--model`` named.

    Attributes:
        name: the served model name: the built-in name, the folder's name, or the GGUF file's name without
            ``.gguf``.
        path: the HF folder to load (config.json + *.safetensors + tokenizer).
        source: ``"builtin"``, ``"folder"`` or ``"gguf"``.
    """

    name: str
    path: Path
    source: Literal["builtin", "folder", "gguf"]


def check_model_folder(path: Path, spec: str) -> None:
    """Raise ModelLoadError unless ``path`` holds config.json, at least one ``*.safetensors`` and a tokenizer
    (``tokenizer.json``, ``tokenizer.model`` or ``tokenizer_config.json``)."""
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"--model {spec} is not a model folder: config.json is missing")
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"--model {spec} is not a model folder: no *.safetensors weights")
    if not any((path / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise ModelLoadError(f"--model {spec} is not a model folder: no tokenizer "
                             f"(tokenizer.json, tokenizer.model or tokenizer_config.json)")


def _looks_like_path(spec: str) -> bool:
    return spec.startswith(("/", ".", "~")) or spec.lower().endswith(".gguf") or "\\" in spec


def resolve_model(spec: str, *, progress: bool = True) -> ResolvedModel:
    """Turn a ``--model`` value into a loadable HF folder.

    Accepts, in this order: a built-in name (:func:`ferrylm.models.builtin.builtin_names`; converted into the cache
    on first use), an existing local folder (checked by :func:`check_model_folder`), or an existing local ``.gguf``
    file (Llama architecture; converted into the cache like the built-in, keyed by its size and mtime).

    Raises:
        ModelLoadError: ``synthetic:`` specs (not implemented yet); a missing path; a folder lacking config.json,
            weights or tokenizer; a file that is not ``.gguf``; a name that is neither a path nor a built-in
            (hub ids included: nothing is downloaded); a GGUF that cannot be converted.
    """
    from ferrylm.models import builtin

    if spec.startswith(SYNTHETIC_PREFIX):
        raise ModelLoadError("synthetic models are not implemented yet")
    if spec in builtin.builtin_names():
        return ResolvedModel(spec, builtin.ensure_builtin(spec, progress=progress), "builtin")
    if not spec.strip():
        raise ModelLoadError(f"--model is empty; built-in names: {', '.join(builtin.builtin_names())}")
    p = Path(spec).expanduser()
    if not p.exists():
        if _looks_like_path(spec):
            raise ModelLoadError(f"--model {spec}: path does not exist")
        raise ModelLoadError(f"--model {spec} is neither a local path nor a built-in name "
                             f"(built-in: {', '.join(builtin.builtin_names())}); nothing is downloaded from a hub")
    p = p.resolve()
    if p.is_dir():
        check_model_folder(p, spec)
        return ResolvedModel(p.name, p, "folder")
    if p.suffix.lower() != ".gguf":
        raise ModelLoadError(f"--model {spec} is a file but not a .gguf file; give a model folder or a .gguf file")
    from ferrylm.models.gguf_convert import convert_gguf, source_key

    try:
        key = source_key(p)
    except OSError as e:
        raise ModelLoadError(f"--model {spec}: cannot read it: {e}") from None
    dest = builtin.cache_dir() / f"{p.stem}-{key}"
    return ResolvedModel(p.stem, convert_gguf(p, dest, progress=progress), "gguf")
