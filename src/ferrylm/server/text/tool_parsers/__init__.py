"""Tool-call output parsers of the formats besides Hermes, one module per format family.

- ``block.py``: what every tag-delimited format shares (:class:`~ferrylm.server.text.tool_parsers.block.BlockToolParser`,
  the loop that holds a block until its closing tag; value typing by the tool's schema; small matching helpers).
- ``deepseek_v3.py``: DeepSeek-V3 / V3.1 / R1 (``<｜tool▁calls▁begin｜>`` sections).
- ``kimi_k2.py``: Kimi-K2 (``<|tool_calls_section_begin|>`` sections, ``functions.NAME:IDX`` ids).
- ``qwen3_coder.py``: Qwen3-Coder / Qwen3-Next / Qwen3.5 (``<tool_call>`` + ``<function=NAME>`` +
  ``<parameter=KEY>``).

GLM-4.5 and MiniMax-M2 live in :mod:`ferrylm.server.text.tool_formats`, which also picks the served model's format and
renders earlier calls back into a prompt. Nothing here imports torch.
"""
