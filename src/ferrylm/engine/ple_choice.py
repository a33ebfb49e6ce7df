"""The boot's per-layer-embedding step: ``--ple-backend`` resolved to a placement of the PLE tables
(``checkpoints/ple_tables.py``) from their size and the memory the plan starts from, before anything loads. A table
too large for where it was asked (or for every memory) is placed further out (device -> host -> disk), never
refused; the rows a step reads are the same wherever the tables live."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil
import torch

from ferrylm.config import EngineConfig, ModelConfig
from ferrylm.models.registry import get_model_class

log = logging.getLogger("ferrylm.engine")

#: the share of the device memory the plan starts from (the limit, else what is free) PLE tables may take there
DEVICE_SHARE = 0.25
#: the share of the host's available memory (beside what the model keeps there) PLE tables may take there
HOST_SHARE = 0.5


@dataclass(frozen=True)
class PleChoice:
    """Where the tables go (``gpu`` / ``host`` / ``disk``), their bytes, and why."""

    backend: str
    table_bytes: int
    reason: str


def choose_ple_backend(requested: str, table_bytes: int, device_bytes: int | None, host_bytes: int) -> PleChoice:
    """The placement rule.

    Args:
        requested: ``--ple-backend`` (``auto``, ``gpu``, ``host``, ``disk``).
        table_bytes: all PLE tables at the model dtype.
        device_bytes: device memory the plan starts from; None without a GPU (the device is host memory).
        host_bytes: host memory available beside what the model keeps there.
    """
    gib = table_bytes / 2**30
    fits_host = table_bytes <= HOST_SHARE * host_bytes
    fits_device = fits_host if device_bytes is None else table_bytes <= DEVICE_SHARE * device_bytes
    if requested == "disk":
        return PleChoice("disk", table_bytes, "--ple-backend disk")
    if requested in ("gpu", "auto") and fits_device:
        where = "gpu" if device_bytes is not None else "host"
        return PleChoice(where, table_bytes, f"{gib:.2f} GiB fit the device's share ({DEVICE_SHARE:.0%})")
    if requested != "host" and device_bytes is not None:
        why = f"{gib:.2f} GiB exceed {DEVICE_SHARE:.0%} of the device's {device_bytes / 2**30:.2f} GiB"
    else:
        why = f"--ple-backend {requested}"
    if fits_host:
        return PleChoice("host", table_bytes, why)
    return PleChoice("disk", table_bytes, f"{why}; {gib:.2f} GiB exceed {HOST_SHARE:.0%} of the host's available "
                                          f"{host_bytes / 2**30:.2f} GiB")


def resolve_ple_backend(mcfg: ModelConfig, config: EngineConfig, device: torch.device,
                        dtype: torch.dtype) -> PleChoice | None:
    """The placement of ``mcfg``'s PLE tables under ``config.ple_backend`` (None: the model has none); logged,
    with a warning when the tables did not fit where they were asked to go."""
    from ferrylm.engine.expert_choice import model_host_bytes

    shape_of = getattr(get_model_class(mcfg.architecture), "ple_shape", None)   # only Qwen4-Exp has PLE
    shape = shape_of(mcfg) if shape_of is not None else None
    if shape is None:
        return None
    device_bytes = None
    if device.type == "cuda":
        device_bytes = (int(config.gpu_memory_limit * 2**30) if config.gpu_memory_limit is not None
                        else torch.cuda.mem_get_info(device)[0])
    kept, _ = model_host_bytes(mcfg, device, dtype, config.moe_backend)
    host = max(0, int(psutil.virtual_memory().available) - kept)
    choice = choose_ple_backend(config.ple_backend, shape.table_bytes(dtype), device_bytes, host)
    asked = config.ple_backend
    moved = asked not in ("auto", choice.backend) and not (asked == "gpu" and device_bytes is None)
    (log.warning if moved else log.info)("--ple-backend %s -> %s: %s", asked, choice.backend, choice.reason)
    return choice
