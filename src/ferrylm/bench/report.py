"""Where a bench command's results go: the output paths it names, checked before any work; its table on stdout;
its summary written as JSON. Imports no torch (``bench serve`` is a plain HTTP client)."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class OutputFlag:
    """A flag of a bench command that names where it writes.

    Attributes:
        flag: the option (``--output-json``).
        dest: its namespace key.
        folder: the path is a folder the command creates (with its parents), not a file it writes.
    """

    flag: str
    dest: str
    folder: bool = False


def add_output_flag(p: argparse.ArgumentParser, flag: str, *, help: str, default: str | None = None,
                    folder: bool = False) -> None:
    """Add ``flag`` to ``p`` and record it in ``p``'s ``output_flags`` default, which :func:`check_outputs` reads."""
    action = p.add_argument(flag, default=default, metavar="DIR" if folder else "PATH", help=help)
    known = p.get_default("output_flags") or ()
    p.set_defaults(output_flags=(*known, OutputFlag(flag, action.dest, folder)))


def output_problem(path: str, *, folder: bool = False) -> str | None:
    """Why ``path`` cannot be written (a file whose folder must exist and be writable; ``folder``: a folder that
    exists or whose nearest existing parent is a writable folder), or None when it can."""
    p = Path(path).expanduser()
    if folder:
        if p.exists():
            return None if p.is_dir() and os.access(p, os.W_OK) else \
                (f"{p} is not a folder" if not p.is_dir() else f"folder {p} is not writable")
        parent = next((a for a in p.absolute().parents if a.exists()), None)
        if parent is None or not parent.is_dir():
            return f"{parent} is not a folder"
        return None if os.access(parent, os.W_OK) else f"folder {parent} is not writable (cannot create {p})"
    if p.is_dir():
        return f"{p} is a folder; give a file path"
    parent = p.absolute().parent
    if not parent.exists():
        return f"folder {p.parent} does not exist"
    if not parent.is_dir():
        return f"{p.parent} is not a folder"
    return None if os.access(parent, os.W_OK) else f"folder {p.parent} is not writable"


def check_outputs(args: argparse.Namespace) -> str | None:
    """The first output flag of ``args`` that cannot be written, as ``--flag PATH: why``; None when all can."""
    for out in vars(args).get("output_flags", ()):
        path = vars(args)[out.dest]
        problem = output_problem(path, folder=out.folder) if path else None
        if problem:
            return f"{out.flag} {path}: {problem}"
    return None


def write_json(path: str | Path, data: Any, *, indent: int = 1, sort_keys: bool = False) -> None:
    """Write ``data`` (JSON-serialisable) to ``path`` whole: into a temporary file beside it, then renamed."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n")
    tmp.replace(path)


def report(table: str, summary: Any, output_json: str | None) -> None:
    """Print ``table`` and write ``summary`` (JSON-serialisable) to ``output_json`` when given."""
    print(table)
    if output_json:
        write_json(output_json, summary, indent=2)
