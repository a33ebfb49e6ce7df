"""How a bench command ends: its table on stdout and, with ``--output-json PATH``, its summary written as JSON.
Imports no torch (``bench serve`` is a plain HTTP client)."""

from __future__ import annotations

import json
from typing import Any


def report(table: str, summary: Any, output_json: str | None) -> None:
    """Print ``table`` and write ``summary`` (JSON-serialisable) to ``output_json`` when given (indented by 2)."""
    print(table)
    if output_json:
        with open(output_json, "w") as f:
            json.dump(summary, f, indent=2)
