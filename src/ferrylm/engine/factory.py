"""Build an :class:`Engine` from a model folder and an EngineConfig (used by the engine process and ``LLM``)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ferrylm.config import EngineConfig
from ferrylm.engine.engine import Engine, resolve_device, resolve_dtype

log = logging.getLogger("ferrylm.engine")


def build_engine(model_path: str | Path, config: EngineConfig) -> Engine:
    """Load the model at ``model_path`` (a HF folder) and size the engine.

    Raises:
        ModelLoadError / UnsupportedArchitecture: the folder cannot be served.
        ValueError: a config value is out of range (message names the flag).
    """
    from ferrylm.models.loader import load_model

    config.validate()
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    backend = "resident" if config.moe_backend == "auto" else config.moe_backend
    torch.manual_seed(config.seed)
    loaded = load_model(model_path, device=device, dtype=dtype, moe_backend=backend)
    engine = Engine(loaded.model, loaded.config, config, device=device, dtype=dtype)
    lim = engine.limits
    log.info("engine ready: device=%s dtype=%s max_model_len=%d kv_pool=%d pages x %d tokens = %d tokens, "
             "max_running_requests=%d, max_prefill_length=%d", device, str(dtype).removeprefix("torch."),
             lim.max_model_len, lim.num_pages, lim.page_size, lim.pool_tokens, lim.max_running_requests,
             lim.max_prefill_length)
    return engine
