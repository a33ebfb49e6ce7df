"""DeepSeek-V3.2 tool calls (``deepseek_v32``; the DSML markup of the checkpoint's ``encoding/encoding_dsv32.py``, the
format vLLM's ``deepseek_v32`` parser reads): DeepSeek-V4's invokes and typed parameters
(:mod:`~ferrylm.server.text.tool_parsers.deepseek_v4`) in a ``function_calls`` block::

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

A V4 ``tool_calls`` block is text here, and this block is text to the V4 parser. The checkpoint ships no chat
template (its format is Python beside the weights) and ferrylm serves no V3.2 family, so the prompt side is a
``--chat-template`` or the fallback tools section. This module must not import torch.
"""

from __future__ import annotations

import re

from ferrylm.server.text.tool_parsers.deepseek_v4 import DSML, DeepSeekV4ToolParser, block_tags

CALLS_BEGIN, CALLS_END = block_tags("function_calls")


class DeepSeekV32ToolParser(DeepSeekV4ToolParser):
    """``<｜DSML｜function_calls>`` blocks of DSML invokes (module docstring)."""

    OPEN = CALLS_BEGIN
    CLOSE = CALLS_END
    MARKUP = (CALLS_BEGIN, CALLS_END, DSML, f"<{DSML}", f"</{DSML}")
    # a template that writes the DSML marker and a function_calls block (V4's writes tool_calls)
    TEMPLATE_MARK = rf"(?s){re.escape(DSML)}.*function_calls|function_calls.*{re.escape(DSML)}"
