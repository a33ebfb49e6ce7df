"""Chat templates for checkpoints that ship none: a model whose ``config.json`` ``model_type`` is a key of
:data:`BUILTIN_TEMPLATES` and whose tokenizer has no ``chat_template`` is served with the template file named
there (``server/text/templates/``). DeepSeek-V4 publishes its chat format as Python (``encoding/encoding_dsv4.py``
beside the weights); ``deepseek_v4.jinja`` writes the same prompt. ``--chat-template`` still wins. This module
must not import torch.
"""

from __future__ import annotations

import json
import os
from importlib import resources

#: ``model_type`` -> template file under ``templates/``
BUILTIN_TEMPLATES = {"deepseek_v4": "deepseek_v4.jinja"}


def template_for(model_type: str | None) -> str | None:
    """The built-in template text of ``model_type``, None when it has none."""
    name = BUILTIN_TEMPLATES.get(model_type or "")
    if name is None:
        return None
    return (resources.files("ferrylm.server.text") / "templates" / name).read_text(encoding="utf-8")


def folder_template(folder: str | os.PathLike) -> str | None:
    """The built-in template of the model in ``folder`` (its ``config.json`` ``model_type``), None when the folder
    has no readable config or its model type has no built-in template."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return template_for(model_type if isinstance(model_type, str) else None)
