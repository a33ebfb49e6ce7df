"""A MiniMax-M2 / M2.5-like tokenizer folder for tests: a tiny byte-level BPE whose role markers (``]~!b[``,
``]~b]``, ``[e~[``), ``<think>`` and tool tags are special tokens, with a chat template written here from the
published template's markup (not the real file, which needs the hub): tools listed in ``<tools>``, earlier
reasoning as ``<think>…</think>``, earlier calls as ``<minimax:tool_call><invoke name=…><parameter name=…>``,
tool results as ``<response>``, and a generation prompt that opens ``<think>`` itself (the model's output starts
inside the block, without the opening tag). Nothing here needs a network or torch."""

from __future__ import annotations

import json
from pathlib import Path

MINIMAX_SPECIALS = ["]~!b[", "]~b]", "[e~[", "<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"]
MINIMAX_TEMPLATE = (
    "]~!b[]~b]system\nYou are a helpful assistant.{% if tools %}{{ '\\n\\n' }}# Tools\n<tools>\n{% for t in tools %}"
    "<tool>{{ t.function | tojson }}</tool>\n{% endfor %}</tools>\nCall tools as\n<minimax:tool_call>\n"
    "<invoke name=\"tool-name\">\n<parameter name=\"key\">value</parameter>\n</invoke>\n</minimax:tool_call>"
    "{% endif %}[e~[\n"
    "{% for m in messages %}{% if m.role == 'user' %}]~b]user\n{{ m.content }}[e~[\n"
    "{% elif m.role == 'tool' %}]~b]tool\n<response>{{ m.content }}</response>[e~[\n"
    "{% elif m.role == 'assistant' %}]~b]ai\n{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n"
    "</think>\n\n{% endif %}{{ m.content or '' }}{% if m.tool_calls %}{{ '\\n' }}<minimax:tool_call>\n"
    "{% for c in m.tool_calls %}<invoke name=\"{{ c.function.name }}\">\n"
    "{% for k, v in c.function.arguments.items() %}<parameter name=\"{{ k }}\">{{ v }}</parameter>\n{% endfor %}"
    "</invoke>\n{% endfor %}</minimax:tool_call>{% endif %}[e~[\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}]~b]ai\n<think>\n{% endif %}")


def build_minimax_like_tokenizer(folder: Path) -> Path:
    """Write the tokenizer folder (tokenizer.json + tokenizer_config.json with the template) into ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=MINIMAX_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(['Hello world! Let me look. get_weather city Paris days <invoke name="'] * 50, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "]~!b[", "eos_token": "[e~[",
        "clean_up_tokenization_spaces": False, "model_max_length": 4096, "chat_template": MINIMAX_TEMPLATE,
        "additional_special_tokens": MINIMAX_SPECIALS[3:]}))
    return folder
