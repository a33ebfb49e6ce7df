"""Offline ``LLM.chat`` takes vLLM's single-conversation form as well as a list of conversations (no model)."""

from __future__ import annotations

import pytest

from ferrylm import LLM
from ferrylm.errors import InvalidRequest


class _Codec:
    def apply_chat_template(self, conv, add_generation_prompt=True):
        return [len(conv), int(add_generation_prompt)]


def _llm() -> LLM:
    llm = LLM.__new__(LLM)
    llm.codec = _Codec()
    llm._run = lambda encoded, params: [ids for _, ids in encoded]   # what would be run, one per conversation
    return llm


def test_single_conversation_form() -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert _llm().chat(msgs) == [[2, 1]]


def test_list_of_conversations_form() -> None:
    a = [{"role": "user", "content": "Hi"}]
    b = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "?"}]
    assert _llm().chat([a, b]) == [[1, 1], [3, 1]]
    assert _llm().chat((a,), add_generation_prompt=False) == [[1, 0]]


@pytest.mark.parametrize("bad", ["hi", [], [[]], [["hi"]], [{"content": "no role"}], 5])
def test_bad_forms_are_invalid_requests(bad) -> None:
    with pytest.raises(InvalidRequest) as e:
        _llm().chat(bad)
    assert e.value.param == "messages"
