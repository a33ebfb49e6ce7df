"""Configuration objects: what the model is (ModelConfig, from config.json) and how to serve it (ServeConfig).

Frozen dataclasses passed down explicitly; no module-level mutable state. This module must stay light (no torch
import) because the CLI and the HTTP frontend import it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ferrylm.errors import ModelLoadError


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the engine and the model code need, read from a HF ``config.json``.

    Attributes:
        architecture: HF ``architectures[0]`` (e.g. ``"LlamaForCausalLM"``, ``"MixtralForCausalLM"``).
        hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim, vocab_size: shapes.
        max_position_embeddings: the model context in tokens.
        rms_norm_eps, rope_theta: numerics; ``rope_scaling`` the config's dict (or None).
        tie_word_embeddings: lm_head shares the embedding matrix.
        num_experts, num_experts_per_tok, moe_intermediate_size: MoE shape (0 for dense models).
        eos_token_ids: token ids that end generation (config ``eos_token_id``, int or list).
        raw: the whole config.json as a dict, for family-specific fields.
    """

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    eos_token_ids: tuple[int, ...] = ()
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a config.json dict. Raises ModelLoadError when a required field is missing."""
        archs = d.get("architectures") or []
        if not archs:
            raise ModelLoadError("config.json has no 'architectures' field")
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            layers = int(d["num_hidden_layers"])
            vocab = int(d["vocab_size"])
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None
        eos = d.get("eos_token_id")
        eos_ids: tuple[int, ...] = () if eos is None else (tuple(eos) if isinstance(eos, list) else (int(eos),))
        num_experts = int(d.get("num_local_experts") or d.get("num_experts") or 0)
        rope_theta = d.get("rope_theta")
        rope_params = d.get("rope_parameters") or {}
        if rope_theta is None:
            rope_theta = rope_params.get("rope_theta", 10000.0)
        rope_scaling = d.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = dict(rope_params)
        return cls(
            architecture=archs[0],
            hidden_size=hidden,
            intermediate_size=int(d.get("intermediate_size") or 0),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            vocab_size=vocab,
            max_position_embeddings=int(d.get("max_position_embeddings") or 2048),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            num_experts=num_experts,
            num_experts_per_tok=int(d.get("num_experts_per_tok") or 0) if num_experts else 0,
            moe_intermediate_size=int(d.get("moe_intermediate_size") or d.get("intermediate_size") or 0)
            if num_experts else 0,
            eos_token_ids=eos_ids,
            raw=dict(d),
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> "ModelConfig":
        """Read ``path/config.json``. Raises ModelLoadError naming the missing or unreadable file."""
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ModelLoadError(f"{path} is not a model folder: config.json is missing")
        try:
            d = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"cannot read {p}: {e}") from None
        return cls.from_dict(d)
