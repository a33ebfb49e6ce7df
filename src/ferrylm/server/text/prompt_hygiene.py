"""Agent prompt hygiene: parts of what coding agents send that change on every request without meaning anything
to the model, removed before templating so that consecutive turns share their token prefix (prefix caching).

- Claude Code (>= 2.1) puts ``x-anthropic-billing-header: cc_version=...; cc_entrypoint=...; cch=<hash>;`` as the
  first line (its first ``system`` text block) of the system prompt; ``cch`` changes with every request, so the
  prompt would differ from the previous turn after a few dozen tokens. llama.cpp, Ollama, SGLang and vLLM-MLX drop
  it too. Only such lines at the top of the system prompt are removed; the same text anywhere else is kept.

This module must not import torch.
"""

from __future__ import annotations

import re

_BILLING = re.compile(r"\A(?:[ \t]*x-anthropic-billing-header:[^\n]*(?:\n|\Z))+")


def strip_billing_header(system: str) -> str:
    """``system`` without the ``x-anthropic-billing-header: ...`` lines at its top (unchanged when it has none)."""
    if "x-anthropic-billing-header:" not in system[:4096]:
        return system
    return _BILLING.sub("", system, count=1)
