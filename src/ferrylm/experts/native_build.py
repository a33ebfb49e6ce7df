"""Building the native CPU expert kernel (``experts/native/``): its sources, the compiler's identity, one compile.
The loader and the ctypes bindings are in :mod:`ferrylm.experts.cpu_kernel`."""

from __future__ import annotations

import subprocess
from importlib import resources
from pathlib import Path

from ferrylm.errors import FerryError

CFLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-ffp-contract=off"]
SOURCES = ("expert_gemv.c", "isa_kernels.h", "decode_attention.h")


class KernelBuildError(FerryError):
    """The native kernel could not be compiled or loaded (message: the command and the compiler's output)."""

    code = "cpu_kernel_unavailable"
    param = "--moe-cpu-kernel"


def read_sources() -> dict[str, str]:
    """The kernel's C sources shipped in the package: file name -> text."""
    native = resources.files("ferrylm.experts").joinpath("native")
    return {name: native.joinpath(name).read_text() for name in SOURCES}


def compiler_version(cc: list[str]) -> str:
    """``cc --version``'s output (part of the build cache key). Raises KernelBuildError: no such compiler."""
    try:
        return subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"no C compiler {' '.join(cc)!r} ({e}); set $CC or use --moe-cpu-kernel torch") from e


def compile_library(cc: list[str], srcs: dict[str, str], folder: Path) -> Path:
    """Compile ``srcs`` (file name -> text; the first is the C file) in ``folder``; returns the library's path.
    Raises KernelBuildError (the compiler failed) or OSError (``folder`` not writable)."""
    for name, text in srcs.items():
        (folder / name).write_text(text)
    c_file, out = folder / SOURCES[0], folder / "expert_gemv.so"
    cmd = [*cc, *CFLAGS, str(c_file), "-o", str(out), "-lm"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{' '.join(cmd)}: {e}") from e
    if r.returncode != 0:
        raise KernelBuildError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    if not out.is_file():
        raise KernelBuildError(f"{' '.join(cmd)} exited 0 but wrote no library")
    return out
