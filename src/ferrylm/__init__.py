"""ferrylm: serve MoE LLMs larger than your GPU through an OpenAI-compatible API."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import ferrylm` (CLI start-up, the HTTP frontend) does not import torch.
    if name == "LLM":
        from ferrylm.llm import LLM

        return LLM
    if name == "SamplingParams":
        from ferrylm.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
