"""A GLM-4.5-like tokenizer folder for tests: a tiny byte-level BPE whose tool tags and ``<think>`` are special
tokens, as in GLM-4.5's vocabulary, with a chat template written here from the published template's markup (not
the real file, which needs the hub). Nothing here needs a network or torch."""

from __future__ import annotations

import json
from pathlib import Path

GLM_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<arg_key>",
                "</arg_key>", "<arg_value>", "</arg_value>", "<think>", "</think>", "<|user|>", "<|assistant|>",
                "<|system|>", "<|observation|>"]
GLM_TEMPLATE = (
    "[gMASK]<sop>{% if tools %}<|system|>\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call one as <tool_call>{function-name}\n<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n"
    "</tool_call>{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>\n{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
    "{% endif %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_glm_like_tokenizer(folder: Path) -> Path:
    """Write the tokenizer folder (tokenizer.json + tokenizer_config.json with the template) into ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=GLM_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["Hello world! Let me look. get_weather city Paris days"] * 50, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False, "model_max_length": 4096, "chat_template": GLM_TEMPLATE,
        "additional_special_tokens": GLM_SPECIALS[3:]}))
    return folder
