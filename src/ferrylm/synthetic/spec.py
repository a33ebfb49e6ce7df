"""Synthetic models: real architecture shapes, random weights made in memory, optional Zipf-skewed routing.

``--model synthetic:<preset>[:layers=N][:skew=A][:routing=R][:seed=S][:quant=Q][:tokenizer=FOLDER]``

- ``preset``: a published model's shape (:data:`~ferrylm.synthetic.presets.PRESETS`; ``ferry models`` lists them).
- ``layers=N``: keep the first ``N`` decoder layers (``1 <= N <=`` the preset's); every layer keeps its shape, so
  per-layer cost is the real model's.
- ``skew=A``: Zipf exponent ``A >= 0`` of expert popularity (0, the default, = uniform); see
  :mod:`ferrylm.checkpoints.synthetic_build` for the method.
- ``routing=R``: who chooses each token's experts (:data:`~ferrylm.synthetic.routing_profiles.ROUTING_CHOICES`):
  ``router`` (the random router's own top-k, shaped by ``skew``) or a routing-model profile (``qwen3``, ``olmoe``,
  ``wide512`` calibrated to published locality figures, ``uniform`` the worst case; see
  :mod:`ferrylm.synthetic.routing_model` and docs/ROUTING.md). Default: the preset family's calibrated profile
  (Qwen-MoE presets ``qwen3``, OLMoE ``olmoe``), or ``router`` when ``skew`` is given or the family has none.
- ``seed=S``: weight seed (default 0). Same spec → same weights → same logits, run after run.
- ``quant=Q``: routed experts quantized (:data:`SYNTHETIC_QUANT`: ``fp8``, ``int4``, ``mxfp4``, ``nvfp4``, GGML
  blocks ``q4_k``, ``q4_k_m``, ``q8_0``): random
  codes and scales made directly in the stored format (nothing is quantized from bf16), so banks, slots and copies
  carry the bytes a real checkpoint of that format has.
- ``tokenizer=FOLDER``: a tokenizer folder for serving text (``ferry --tokenizer FOLDER`` appends it); it must be
  the last option (it takes the rest of the spec, so the path may contain ``:``). Without it the model is token
  ids in, token ids out.

No checkpoint is written. :func:`materialize` writes a small folder into the model cache holding the
``config.json`` (an HF config of the preset plus a ``ferrylm_synthetic`` recipe key) and links to the tokenizer
files, so that every part that passes a model *folder* around (the engine process, the server's config and
tokenizer reading) works unchanged; the engine builds the weights from the recipe
(:func:`ferrylm.checkpoints.synthetic_build.build_synthetic`, called by ``load_model``).

This module does not import torch (the CLI and the HTTP frontend use it).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ferrylm.config import ROUTER_BIAS_KEY
from ferrylm.errors import ModelLoadError
from ferrylm.synthetic.presets import PRESETS, SyntheticPreset
from ferrylm.synthetic.routing_profiles import ROUTER, ROUTING_CHOICES, default_routing

SYNTHETIC_PREFIX = "synthetic:"
RECIPE_KEY = "ferrylm_synthetic"  # config.json key holding the recipe; its presence marks a synthetic folder
RECIPE_FORMAT = 1
# NOTE: a ferrylm-only config.json key: ``{"profile": name, "seed": S}`` when a routing model chooses the experts
# (synthetic ``routing=`` other than ``router``; models/moe.py, synthetic/routing_model.py).
ROUTING_KEY = "ferrylm_routing"
#: ``quant=`` names -> what the routed experts become (:mod:`ferrylm.checkpoints.synthetic_build` has the formats)
SYNTHETIC_QUANT = {
    "fp8": "fp8 e4m3, float32 scale per 128 inputs (as DeepSeek-V3 / Qwen3-FP8 128x128 blocks)",
    "int4": "int4 symmetric, bfloat16 scale per 128 inputs (as compressed-tensors W4A16)",
    "mxfp4": "fp4 e2m1, power-of-two scale per 32 inputs (OCP MXFP4, as gpt-oss)",
    "nvfp4": "fp4 e2m1, fp8 e4m3 scale per 16 inputs and a float32 scale per row (NVFP4)",
    "q4_k": "GGML Q4_K blocks, 4.5 bits/weight (as a GGUF's experts, kept as bytes)",
    "q4_k_m": "GGML Q4_K gate/up, Q6_K down blocks (llama.cpp Q4_K_M's heavier layers)",
    "q8_0": "GGML Q8_0 blocks, 8.5 bits/weight",
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                    "special_tokens_map.json", "added_tokens.json")


@dataclass(frozen=True)
class SyntheticSpec:
    """A parsed ``synthetic:`` spec.

    Attributes:
        preset: the shape (a :class:`SyntheticPreset`; tests may pass their own).
        layers: decoder layers kept (``1 ..`` the preset's).
        skew: Zipf exponent of expert popularity (0 = uniform).
        seed: weight seed.
        tokenizer: absolute path of a tokenizer folder, or None.
        quant: a :data:`SYNTHETIC_QUANT` name for the routed experts, or None (plain weights).
        routing: ``router`` or a routing profile name (see the module docstring); a spec built directly (not
            parsed) keeps the router's own routing unless it says otherwise.
    """

    preset: SyntheticPreset
    layers: int
    skew: float = 0.0
    seed: int = 0
    tokenizer: str | None = None
    quant: str | None = None
    routing: str = ROUTER

    @property
    def name(self) -> str:
        """The canonical spec without the tokenizer (the served model name): defaults left out, e.g.
        ``synthetic:qwen3-30b-a3b:layers=2``."""
        parts = [SYNTHETIC_PREFIX + self.preset.name]
        if self.layers != self.preset.config["num_hidden_layers"]:
            parts.append(f"layers={self.layers}")
        if self.skew:
            parts.append(f"skew={self.skew:g}")
        if self.routing != default_routing(self.preset.config.get("model_type", ""), self.skew):
            parts.append(f"routing={self.routing}")
        if self.seed:
            parts.append(f"seed={self.seed}")
        if self.quant:
            parts.append(f"quant={self.quant}")
        return ":".join(parts)

    def config(self) -> dict[str, Any]:
        """The HF-style config.json dict of the synthetic model (see :func:`synthetic_config`)."""
        return synthetic_config(self)


def is_synthetic_spec(spec: str) -> bool:
    return spec.startswith(SYNTHETIC_PREFIX)


def parse_synthetic_spec(spec: str) -> SyntheticSpec:
    """Parse ``synthetic:<preset>[:layers=N][:skew=A][:routing=R][:seed=S][:quant=Q][:tokenizer=FOLDER]`` (options
    in any order, each at most once, ``tokenizer`` last).

    Raises:
        ModelLoadError: not a synthetic spec, unknown preset (the message lists the presets), unknown or repeated
            option, a value out of range (``layers`` in ``1 .. preset layers``, ``skew >= 0`` and finite,
            ``seed >= 0``, ``quant`` one of :data:`SYNTHETIC_QUANT`, ``routing`` one of ``ROUTING_CHOICES``), a
            tokenizer folder that does not exist.
    """
    if not is_synthetic_spec(spec):
        raise ModelLoadError(f"{spec!r} is not a synthetic model spec (it starts with {SYNTHETIC_PREFIX!r})")
    body = spec[len(SYNTHETIC_PREFIX):]
    tokenizer = None
    if ":tokenizer=" in f":{body}":
        body, _, tokenizer = f":{body}".partition(":tokenizer=")
        body = body[1:]
    name, *options = body.split(":") if body else [""]
    preset = PRESETS.get(name)
    if preset is None:
        raise ModelLoadError(f"unknown synthetic preset {name!r}; presets: {', '.join(PRESETS)} "
                             f"(spec: synthetic:<preset>[:layers=N][:skew=A][:routing=R][:seed=S][:quant=Q])")
    values: dict[str, str] = {}
    for opt in options:
        key, eq, value = opt.partition("=")
        if key not in ("layers", "skew", "seed", "quant", "routing") or not eq:
            raise ModelLoadError(f"{spec}: unknown option {opt!r}; options: layers=N, skew=A, "
                                 f"routing={'|'.join(ROUTING_CHOICES)}, seed=S, "
                                 f"quant={'|'.join(SYNTHETIC_QUANT)}, tokenizer=FOLDER")
        if key in values:
            raise ModelLoadError(f"{spec}: option {key!r} given twice")
        values[key] = value
    max_layers = int(preset.config["num_hidden_layers"])
    try:
        layers = int(values.get("layers", max_layers))
        skew = float(values.get("skew", 0.0))
        seed = int(values.get("seed", 0))
    except ValueError as e:
        raise ModelLoadError(f"{spec}: bad option value ({e})") from None
    if not 1 <= layers <= max_layers:
        raise ModelLoadError(f"{spec}: layers must be in 1..{max_layers} for {name}, got {layers}")
    if not (skew >= 0 and skew < float("inf")):
        raise ModelLoadError(f"{spec}: skew must be a finite number >= 0, got {values.get('skew')}")
    if seed < 0:
        raise ModelLoadError(f"{spec}: seed must be >= 0, got {seed}")
    quant = values.get("quant")
    if quant is not None and quant not in SYNTHETIC_QUANT:
        raise ModelLoadError(f"{spec}: unknown quant {quant!r}; quant formats: {', '.join(SYNTHETIC_QUANT)}")
    if tokenizer is not None:
        tok = Path(tokenizer).expanduser()
        if not tok.is_dir():
            raise ModelLoadError(f"{spec}: tokenizer folder {tokenizer!r} does not exist")
        tokenizer = str(tok.resolve())
    routing = values.get("routing", default_routing(preset.config.get("model_type", ""), skew))
    if routing not in ROUTING_CHOICES:
        raise ModelLoadError(f"{spec}: unknown routing {routing!r}; routing: {', '.join(ROUTING_CHOICES)}")
    return SyntheticSpec(preset, layers, skew, seed, tokenizer, quant, routing)


def with_tokenizer(spec: str, tokenizer: str | None) -> str:
    """``spec`` with ``:tokenizer=<abs path>`` appended (how ``--tokenizer`` reaches every reader of ``--model``).

    Raises:
        ModelLoadError: ``spec`` is not synthetic (model folders carry their own tokenizer) or already names one.
    """
    if tokenizer is None:
        return spec
    if not is_synthetic_spec(spec):
        raise ModelLoadError("--tokenizer applies to synthetic: models only (a model folder carries its own "
                             "tokenizer)")
    if ":tokenizer=" in spec:
        raise ModelLoadError(f"{spec} already names a tokenizer; drop --tokenizer or the spec's tokenizer=")
    return f"{spec}:tokenizer={Path(tokenizer).expanduser().resolve()}"


def synthetic_config(spec: SyntheticSpec) -> dict[str, Any]:
    """The config.json dict: the preset's, with ``num_hidden_layers = spec.layers`` (``mlp_only_layers`` and
    ``layer_types`` cut to them), ``torch_dtype`` bfloat16, the router-bias switch when ``skew > 0``, the routing-model key
    (``ROUTING_KEY``) when ``routing`` is a profile, and the recipe under ``RECIPE_KEY``."""
    cfg = copy.deepcopy(spec.preset.config)
    cfg["num_hidden_layers"] = spec.layers
    if cfg.get("mlp_only_layers"):
        cfg["mlp_only_layers"] = [i for i in cfg["mlp_only_layers"] if i < spec.layers]
    if "max_window_layers" in cfg:
        cfg["max_window_layers"] = min(int(cfg["max_window_layers"]), spec.layers)
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = cfg["layer_types"][:spec.layers]
    cfg["torch_dtype"] = "bfloat16"
    if spec.skew > 0:
        cfg[ROUTER_BIAS_KEY] = True
    cfg[RECIPE_KEY] = {"format": RECIPE_FORMAT, "preset": spec.preset.name, "source": spec.preset.source,
                       "layers": spec.layers, "skew": spec.skew, "seed": spec.seed,
                       "preset_config": spec.preset.config}
    if spec.quant:
        cfg[RECIPE_KEY]["quant"] = spec.quant
    if spec.routing != ROUTER:
        cfg[RECIPE_KEY]["routing"] = spec.routing
        cfg[ROUTING_KEY] = {"profile": spec.routing, "seed": spec.seed}
    return cfg


def read_config(model_dir: str | os.PathLike) -> dict[str, Any] | None:
    """``model_dir/config.json`` as a dict, or None when missing or unreadable."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def is_synthetic_folder(model_dir: str | os.PathLike) -> bool:
    """True when ``model_dir`` is a folder made by :func:`materialize` (its config.json holds ``RECIPE_KEY``)."""
    cfg = read_config(model_dir)
    return isinstance(cfg, dict) and isinstance(cfg.get(RECIPE_KEY), dict)


def spec_from_folder(model_dir: str | os.PathLike) -> SyntheticSpec:
    """The :class:`SyntheticSpec` recorded in a synthetic folder's config.json.

    Raises:
        ModelLoadError: not a synthetic folder, or a recipe of an unknown format.
    """
    cfg = read_config(model_dir)
    recipe = cfg.get(RECIPE_KEY) if isinstance(cfg, dict) else None
    if not isinstance(recipe, dict):
        raise ModelLoadError(f"{model_dir} is not a synthetic model folder (config.json lacks {RECIPE_KEY!r})")
    if recipe.get("format") != RECIPE_FORMAT:
        raise ModelLoadError(f"{model_dir}: synthetic recipe format {recipe.get('format')!r} is not "
                             f"{RECIPE_FORMAT}; remove the folder and resolve the spec again")
    preset = SyntheticPreset(recipe["preset"], recipe.get("source", ""), recipe["preset_config"])
    return SyntheticSpec(preset, int(recipe["layers"]), float(recipe["skew"]), int(recipe["seed"]), None,
                         recipe.get("quant"), recipe.get("routing", ROUTER))


def _max_token_id(tokenizer_dir: Path) -> int | None:
    """Largest token id in ``tokenizer.json`` (base vocabulary and added tokens), or None without that file."""
    path = tokenizer_dir / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None
    vocab = (data.get("model") or {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    ids += [t.get("id", 0) for t in data.get("added_tokens") or []]
    return max(ids) if ids else None


def check_tokenizer(spec: SyntheticSpec) -> None:
    """Raise ModelLoadError when ``spec.tokenizer`` holds no tokenizer files or produces ids the model's
    vocabulary does not cover."""
    if spec.tokenizer is None:
        return
    tok = Path(spec.tokenizer)
    if not any((tok / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise ModelLoadError(f"--tokenizer {tok}: no tokenizer.json, tokenizer.model or tokenizer_config.json")
    top = _max_token_id(tok)
    vocab = int(spec.preset.config["vocab_size"])
    if top is not None and top >= vocab:
        raise ModelLoadError(f"--tokenizer {tok}: token ids reach {top}, beyond the vocabulary of "
                             f"{spec.preset.name} ({vocab} ids)")


def materialize(spec: SyntheticSpec, root: Path) -> Path:
    """Write (once) the folder that stands for ``spec`` under ``root``: ``config.json`` and, with a tokenizer,
    symlinks to its files (copies where links fail). Concurrent callers are safe: the folder is built under a
    temporary name and renamed into place; a loser of the race uses the winner's identical folder.

    Returns:
        ``root / "<preset>-<hash>"``, the hash covering the config and the tokenizer path.

    Raises:
        ModelLoadError: the tokenizer does not fit (:func:`check_tokenizer`) or ``root`` cannot be written.
    """
    check_tokenizer(spec)
    cfg = synthetic_config(spec)
    key = hashlib.sha256(json.dumps([cfg, spec.tokenizer], sort_keys=True).encode()).hexdigest()[:16]
    dest = root / f"{spec.preset.name}-{key}"
    if (dest / "config.json").is_file():
        return dest
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=root))
    except OSError as e:
        raise ModelLoadError(f"cannot write the model cache {root}: {e}") from None
    try:
        if spec.tokenizer is not None:
            for name in _TOKENIZER_FILES:
                src = Path(spec.tokenizer) / name
                if src.is_file():
                    try:
                        os.symlink(src, tmp / name)
                    except OSError:
                        shutil.copyfile(src, tmp / name)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / "config.json").is_file():  # not a lost race: a real failure
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelLoadError(f"cannot write the synthetic model folder {dest}: {e}") from None
    return dest


def default_prompt_ids(vocab_size: int, n: int = 16) -> list[int]:
    """A fixed prompt of ``n`` token ids spread over ``[1, vocab_size)`` (for ``ferry generate`` without a prompt)."""
    return [1 + (7919 * k) % (vocab_size - 1) for k in range(n)]


def describe_presets() -> list[str]:
    """``"<name>  <summary>"`` lines for ``ferry models``."""
    width = max(len(n) for n in PRESETS)
    return [f"{SYNTHETIC_PREFIX}{name:<{width}}  {p.summary()}" for name, p in PRESETS.items()]
