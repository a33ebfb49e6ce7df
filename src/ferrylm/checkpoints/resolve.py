"""``--model`` resolution: a built-in name, a ``synthetic:`` spec, a local HF folder or a local ``.gguf`` file -> one
model folder.

Nothing is ever downloaded: a hub id such as ``HuggingFaceTB/SmolLM2-135M-Instruct`` is refused with the list of
built-in names. Every refusal is a :class:`ModelLoadError` with one line naming what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ferrylm.errors import ModelLoadError

SYNTHETIC_PREFIX = "synthetic:"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@dataclass(frozen=True)
class ResolvedModel:
    """What ``--model`` named.

    Attributes:
        name: the served model name: the built-in name, the folder's name, the GGUF file's name without
            ``.gguf``, or the canonical synthetic spec (``synthetic:qwen3-30b-a3b:layers=2``, tokenizer left out).
        path: what to load: an HF folder (config.json + *.safetensors + tokenizer), a ``.gguf`` file itself
            (config, weights and tokenizer read from it: :mod:`ferrylm.checkpoints.quant.gguf_file`; the dense
            built-in model too), or for ``synthetic`` a folder holding only config.json with the recipe (and the tokenizer files when one was named; see
            :mod:`ferrylm.synthetic.spec`).
        source: ``"builtin"``, ``"folder"``, ``"gguf"`` or ``"synthetic"``.
    """

    name: str
    path: Path
    source: Literal["builtin", "folder", "gguf", "synthetic"]

    @property
    def has_tokenizer(self) -> bool:
        """False only for a synthetic model without a tokenizer (token ids in, token ids out)."""
        return has_tokenizer(self.path)


def has_tokenizer(path: Path) -> bool:
    """True when ``path`` holds tokenizer.json, tokenizer.model or tokenizer_config.json, or is a ``.gguf`` file
    (its tokenizer is in its metadata)."""
    if Path(path).suffix.lower() == ".gguf" and Path(path).is_file():
        return True
    return any((Path(path) / n).is_file() for n in TOKENIZER_FILES)


def check_model_folder(path: Path, spec: str) -> None:
    """Raise ModelLoadError unless ``path`` holds config.json, at least one ``*.safetensors`` and a tokenizer
    (``tokenizer.json``, ``tokenizer.model`` or ``tokenizer_config.json``)."""
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"--model {spec} is not a model folder: config.json is missing")
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"--model {spec} is not a model folder: no *.safetensors weights")
    if not has_tokenizer(path):
        raise ModelLoadError(f"--model {spec} is not a model folder: no tokenizer "
                             f"(tokenizer.json, tokenizer.model or tokenizer_config.json)")


def _looks_like_path(spec: str) -> bool:
    return spec.startswith(("/", ".", "~")) or spec.lower().endswith(".gguf") or "\\" in spec


def resolve_model(spec: str, *, progress: bool = True) -> ResolvedModel:
    """Turn a ``--model`` value into a loadable folder or GGUF file.

    Accepts, in this order: a ``synthetic:`` spec (:func:`ferrylm.synthetic.spec.parse_synthetic_spec`; a small
    recipe folder is written into the cache, no weights), a built-in name
    (:func:`ferrylm.checkpoints.builtin.builtin_names`), an existing local folder (checked by
    :func:`check_model_folder`), or an existing local ``.gguf`` file of a served architecture
    (:data:`ferrylm.checkpoints.gguf_archs.ARCHS`), served from the file: nothing converted, nothing written.

    Raises:
        ModelLoadError: a bad ``synthetic:`` spec (unknown preset or option, a tokenizer that does not fit); a
            missing path; a folder lacking config.json, weights or tokenizer; a file that is not ``.gguf``; a
            name that is neither a path nor a built-in (hub ids included: nothing is downloaded); a GGUF that
            cannot be read or whose architecture is not served.
    """
    from ferrylm.checkpoints import builtin

    if spec.startswith(SYNTHETIC_PREFIX):
        from ferrylm.synthetic.spec import materialize, parse_synthetic_spec

        parsed = parse_synthetic_spec(spec)
        return ResolvedModel(parsed.name, materialize(parsed, builtin.cache_dir() / "synthetic"), "synthetic")
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
    from ferrylm.checkpoints.gguf_archs import arch_of
    from ferrylm.checkpoints.gguf_reader import read_gguf

    arch_of(read_gguf(p))  # refuses an architecture not served, naming it
    return ResolvedModel(p.stem, p, "gguf")
