"""What the engine may do with a model family's forward, declared once per family class (``capabilities``) and read
by the model runner (``engine/model_runner.py``) as it is, never probed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelCapabilities:
    """Attributes:
        graph_capture: decode steps may run in CUDA graphs; False: every step runs eager (Qwen4-Exp's multi-stream
            stack, which the decode graphs do not know).
        piecewise_graphs: the piecewise decode graphs (``engine/decode_graph.py``) can cut its layers; False: whole-step
            graphs only, the steps they do not take run eager (DeepSeek-V4's hyper-connection layers).
    """

    graph_capture: bool = True
    piecewise_graphs: bool = True
