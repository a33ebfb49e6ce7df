"""DeepSeek-like and Kimi-like tokenizer folders for tests: a tiny byte-level BPE whose tool tags and ``<think>`` are
special tokens, as in those families' vocabularies, with chat templates written here from the published templates'
markup (not the real files, which need the hub). Nothing here needs a network or torch."""

from __future__ import annotations

import json
from pathlib import Path

from ferrylm.server.text.tool_parsers import deepseek_v3 as ds
from ferrylm.server.text.tool_parsers import kimi_k2 as kimi

BOS, EOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>"
USER, ASSISTANT = "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>"
DEEPSEEK_SPECIALS = [BOS, EOS, USER, ASSISTANT, *ds.MARKUP, "<think>", "</think>"]

#: DeepSeek-R1's shape: the generation prompt opens the reasoning block itself (``<think>\n``); V3.1's shape when
#: ``thinking`` is given: ``<think>`` when true, ``</think>`` (an empty block) when false
_DS_TOOLS = ("{% if tools %}## Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
             "Call as " + ds.CALLS_BEGIN + ds.CALL_BEGIN + "name" + ds.SEP + "{json}" + ds.CALL_END + ds.CALLS_END +
             "{% endif %}")
DEEPSEEK_R1_TEMPLATE = (
    "{{ bos_token }}" + _DS_TOOLS +
    "{% for m in messages %}{% if m.role == 'user' %}" + USER + "{{ m.content }}"
    "{% elif m.role == 'assistant' %}" + ASSISTANT + "{% set c = m.content or '' %}"
    "{% if '</think>' in c %}{% set c = c.split('</think>')[-1] %}{% endif %}{{ c }}" + EOS +
    "{% else %}" + USER + "{{ m.content }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT +
    "{% if thinking is defined %}{% if thinking %}<think>{% else %}</think>{% endif %}"
    "{% else %}<think>\n{% endif %}{% endif %}")

KIMI_SPECIALS = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", *kimi.MARKUP]
KIMI_TEMPLATE = (
    "{% if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>"
    "{% elif m.role == 'assistant' %}<|im_assistant|>assistant<|im_middle|>{{ m.content or '' }}"
    "{% if m.tool_calls %}" + kimi.SECTION_BEGIN + "{% for c in m.tool_calls %}" + kimi.CALL_BEGIN +
    "{{ c.id }}" + kimi.ARGS_BEGIN + "{{ c.function.arguments }}" + kimi.CALL_END + "{% endfor %}" +
    kimi.SECTION_END + "{% endif %}<|im_end|>"
    "{% else %}<|im_system|>tool<|im_middle|>## Return of {{ m.tool_call_id }}\n{{ m.content }}<|im_end|>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}")


def _save_tokenizer(folder: Path, tok, specials: list[str], template: str, eos: str, bos: str | None,
                    model_max_length: int) -> Path:
    """Write ``tok`` as ``folder/tokenizer.json`` and a ``tokenizer_config.json`` naming ``eos`` / ``bos``, the chat
    ``template`` and the other ``specials``."""
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "clean_up_tokenization_spaces": False,
              "model_max_length": model_max_length, "chat_template": template,
              "additional_special_tokens": [s for s in specials if s not in (eos, bos)]}
    if bos is not None:
        config["bos_token"] = bos
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def build_family_tokenizer(folder: Path, specials: list[str], template: str, eos: str, bos: str | None = None) -> Path:
    """Write a tokenizer folder (tokenizer.json + tokenizer_config.json with ``template``) into ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(['Hello world! Let me look. get_weather city Paris days {"city": "Paris"}'] * 50, trainer)
    return _save_tokenizer(folder, tok, specials, template, eos, bos, model_max_length=4096)


def build_deepseek_like(folder: Path) -> Path:
    return build_family_tokenizer(folder, DEEPSEEK_SPECIALS, DEEPSEEK_R1_TEMPLATE, EOS, BOS)


def build_kimi_like(folder: Path) -> Path:
    return build_family_tokenizer(folder, KIMI_SPECIALS, KIMI_TEMPLATE, "<|im_end|>")


def build_wordlevel_tokenizer(folder: Path, vocab_size: int, specials: list[str], template: str, eos: str,
                              bos: str | None = None) -> Path:
    """A tokenizer folder whose ids cover ``[0, vocab_size)``: ``specials`` first, then one word ``w<id>`` per id
    (whitespace-split, so every id a random-weight model samples decodes to text). For serving synthetic presets
    at their published vocabularies, where the real tokenizer needs the hub."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {s: i for i, s in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=specials[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    return _save_tokenizer(folder, tok, specials, template, eos, bos, model_max_length=1 << 17)


def build_deepseek_v3_vocab(folder: Path) -> Path:
    """DeepSeek-V3's 129280 ids, its chat markup as special tokens (:func:`build_wordlevel_tokenizer`)."""
    return build_wordlevel_tokenizer(folder, 129280, DEEPSEEK_SPECIALS, DEEPSEEK_R1_TEMPLATE, EOS, BOS)
