"""The per-machine bandwidth profile ``ferry bench bw`` writes and the boot reads instead of measuring.

File: ``<cache root>/machine-profiles.json`` (:func:`profile_path`), ``{"version": 1, "machines": {id: profile}}``
with one :class:`MachineProfile` per :class:`MachineKey` (CPU model, physical cores, GPU name or none), so a cache
folder shared by several hosts keeps each host's own. Rates are bytes per second. A file that does not parse, an
entry that fails validation or names another machine, a format the profile did not measure, or banks that are
not page-locked (the profile's copies are pinned) make :func:`profile_bandwidths` return None with a log line
saying why; the caller then measures as without a profile.
"""

from __future__ import annotations

import json
import logging
import os
import platform
from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ferrylm.cachedir import cache_root
from ferrylm.experts.options import Bandwidths

log = logging.getLogger("ferrylm.experts")

PROFILE_FILE = "machine-profiles.json"
PROFILE_VERSION = 1
Rate = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class MachineKey(_Frozen):
    """What a profile is valid for: ``cpu`` (model name), ``cores`` (physical), ``gpu`` (device name or None)."""

    cpu: str
    cores: int = Field(gt=0)
    gpu: str | None

    @property
    def id(self) -> str:
        """The key of this machine's entry: CPU model, physical cores, GPU name (or 'no GPU')."""
        return f"{self.cpu} | {self.cores} cores | {self.gpu or 'no GPU'}"


class ThreadRates(_Frozen):
    """The CPU expert kernel at ``threads`` threads: ``alone``, ``with_copies`` (while host->device copies run),
    and ``copies_during``: the rate those copies kept meanwhile."""

    threads: int = Field(gt=0)
    alone: Rate
    with_copies: Rate
    copies_during: float = Field(ge=0, allow_inf_nan=False)


class FormatProfile(_Frozen):
    """One expert format: ``name`` (as ``ferry bench bw --formats`` spells it), ``kernel`` (``native-<isa>`` or
    ``torch``), ``expert_bytes`` of the probe's shape, ``rates`` per thread count, ``best_threads`` (the verdict's),
    ``cpu_latency`` (s, :func:`~ferrylm.experts.bandwidth.cpu_job_latency` at ``best_threads``), and the verdict:
    ``backend`` with its one-line ``reason``."""

    name: str
    kernel: str
    expert_bytes: int = Field(gt=0)
    rates: tuple[ThreadRates, ...] = Field(min_length=1)
    best_threads: int = Field(gt=0)
    cpu_latency: float = Field(ge=0, allow_inf_nan=False)
    backend: str
    reason: str

    def at(self, threads: int) -> ThreadRates:
        """The measured row for ``threads``: the largest thread count measured at or below it (the smallest
        measured when all are above)."""
        below = [r for r in self.rates if r.threads <= threads]
        return max(below, key=lambda r: r.threads) if below else min(self.rates, key=lambda r: r.threads)


class MachineProfile(_Frozen):
    """A machine's rates (``copies``: ``cuda`` for pinned host<->device copies, ``memcpy`` on a host without a GPU,
    where the "device" is host memory) and its expert formats keyed by :func:`format_key`."""

    machine: MachineKey
    measured_at: str
    copies: Literal["cuda", "memcpy"]
    h2d: Rate
    d2h: Rate
    host: Rate
    hbm: Rate
    formats: dict[str, FormatProfile]

    @model_validator(mode="after")
    def _copies_match_gpu(self) -> "MachineProfile":
        if (self.copies == "cuda") != (self.machine.gpu is not None):
            raise ValueError(f"copies {self.copies!r} do not match gpu {self.machine.gpu!r}")
        return self

    def bandwidths(self, key: str, threads: int) -> Bandwidths:
        """:class:`Bandwidths` for format ``key`` with the CPU pool at ``threads`` threads (``FormatProfile.at``)."""
        fmt = self.formats[key]
        row = fmt.at(threads)
        return Bandwidths(pcie=self.h2d, host=self.host, cpu=row.alone, hbm=self.hbm, cpu_latency=fmt.cpu_latency,
                          cpu_with_copies=row.with_copies)


class ProfileFile(_Frozen):
    version: Literal[1]
    machines: dict[str, MachineProfile]


def profile_path() -> Path:
    """The machine-profile JSON under the cache root (one entry per machine id)."""
    return cache_root() / PROFILE_FILE


def cpu_model_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def current_machine(device: torch.device) -> MachineKey:
    """This host's key for ``device`` (its GPU name on CUDA, None on the CPU)."""
    from ferrylm.experts.cpu_pool import physical_cores

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return MachineKey(cpu=cpu_model_name(), cores=physical_cores(), gpu=gpu)


def format_key(layout) -> str:
    """The profile's name for an :class:`~ferrylm.experts.executor.ExpertLayout`'s stored format: its quantized
    formats' description, or the plain dtype (``bfloat16``)."""
    if layout.quant is not None:
        return layout.quant.describe()
    return str(layout.dtype).removeprefix("torch.")


def read_profiles(path: Path | None = None) -> ProfileFile | None:
    """The profile file, None when there is none. Raises ValueError (one line) for a file that does not parse or
    validate."""
    path = path or profile_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return ProfileFile.model_validate_json(text)
    except ValidationError as e:
        first = e.errors()[0]
        raise ValueError(f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None


def save_profile(profile: MachineProfile, path: Path | None = None) -> Path:
    """Add or replace ``profile``'s machine in the file (written atomically); a file that does not parse is
    replaced (with a warning). Returns the path."""
    path = path or profile_path()
    try:
        existing = read_profiles(path)
    except ValueError as e:
        log.warning("machine profile %s does not parse (%s): replaced", path, e)
        existing = None
    machines = dict(existing.machines) if existing else {}
    machines[profile.machine.id] = profile
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(ProfileFile(version=PROFILE_VERSION, machines=machines).model_dump(mode="json"),
                              indent=1) + "\n")
    tmp.replace(path)
    return path


def load_profile(device: torch.device) -> MachineProfile | None:
    """This machine's profile for ``device``, or None (logged: no file, a corrupt file, no entry for this
    machine)."""
    path = profile_path()
    try:
        profiles = read_profiles(path)
    except ValueError as e:
        log.warning("machine profile %s ignored: it does not parse (%s); measuring bandwidths instead "
                    "(ferry bench bw rewrites it)", path, e)
        return None
    if profiles is None:
        return None
    key = current_machine(device)
    found = profiles.machines.get(key.id)
    if found is None or found.machine != key:
        log.info("machine profile %s ignored: it holds %s, not this machine (%s); measuring bandwidths instead "
                 "(ferry bench bw adds it)", path, ", ".join(sorted(profiles.machines)) or "no machine", key.id)
        return None
    return found


def profile_bandwidths(device: torch.device, layout, *, threads: int, pinned: bool) -> Bandwidths | None:
    """:class:`Bandwidths` from this machine's profile for ``layout``'s format at ``threads`` CPU threads, or None
    (logged) when there is no usable profile; the profile's date and the rates are logged when it is used."""
    profile = load_profile(device)
    if profile is None:
        return None
    key = format_key(layout)
    if key not in profile.formats:
        log.info("machine profile has no CPU rate for %s (it has: %s): measuring bandwidths instead",
                 key, ", ".join(profile.formats))
        return None
    if device.type == "cuda" and not pinned:
        log.info("machine profile ignored: it measured pinned copies and the expert banks are pageable; "
                 "measuring bandwidths instead")
        return None
    bw = profile.bandwidths(key, threads)
    log.info("bandwidths from the machine profile %s (ferry bench bw, measured %s): %s GB/s; CPU experts (%s) at "
             "%d threads: %.1f GB/s alone, %.1f beside copies", profile_path(), profile.measured_at,
             {k: round(v / 1e9, 1) for k, v in bw.as_dict().items()}, key, profile.formats[key].at(threads).threads,
             bw.cpu / 1e9, (bw.cpu_with_copies or 0) / 1e9)
    return bw
