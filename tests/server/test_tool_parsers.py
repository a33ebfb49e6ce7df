"""DeepSeek-V3, Kimi-K2, Qwen3-Coder and DeepSeek-V4 / V3.2 (DSML) tool-call parsers (server/text/tool_parsers/): calls and text separated, both
DeepSeek forms (V3 / R1 fenced, V3.1 plain), Kimi's ids kept, Qwen3-Coder values typed by the schema, text that
is not a call never swallowed, any chunking of the stream giving the same calls and text (hypothesis), earlier
calls rendered back into markup the parser reads, DSML values typed by their ``string`` attribute, and the choice of
parser for a model."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrylm.server.api.assistant import TurnConfig, whole_turn
from ferrylm.server.text.tool_parsers import TOOL_PARSERS, choose_tool_parser, format_calls_as, make_tool_parser
from ferrylm.server.text.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from ferrylm.server.text.tool_parsers.deepseek_v4 import DSML, DeepSeekV4ToolParser
from ferrylm.server.text.tool_parsers.deepseek_v32 import DeepSeekV32ToolParser
from ferrylm.server.text.tool_parsers.kimi_k2 import KimiK2ToolParser
from ferrylm.server.text.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from ferrylm.server.text.tool_parsers import deepseek_v3 as ds
from ferrylm.server.text.tool_parsers import kimi_k2 as kimi

NAMES = ("get_weather", "search")
SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
           "search": {"type": "object", "properties": {"q": {"type": "string"}, "filters": {"type": "object"},
                                                        "exact": {"type": "boolean"}}}}
PARSERS = {"deepseek_v3": DeepSeekV3ToolParser, "kimi_k2": KimiK2ToolParser, "qwen3_coder": Qwen3CoderToolParser,
           "deepseek_v4": DeepSeekV4ToolParser, "deepseek_v32": DeepSeekV32ToolParser}

B, E, CB, CE, SEP = ds.CALLS_BEGIN, ds.CALLS_END, ds.CALL_BEGIN, ds.CALL_END, ds.SEP
DS_V3 = (f'{B}{CB}function{SEP}get_weather\n```json\n{{"city": "Paris", "days": 3}}\n```{CE}\n'
         f'{CB}function{SEP}search\n```json\n{{"q": "x", "exact": true}}\n```{CE}{E}')
DS_V31 = f'{B}{CB}get_weather{SEP}{{"city": "Rome"}}{CE}{CB}search{SEP}{{"q": "y"}}{CE}{E}'
KS, KE, KB, KA, KC = kimi.SECTION_BEGIN, kimi.SECTION_END, kimi.CALL_BEGIN, kimi.ARGS_BEGIN, kimi.CALL_END
KIMI = (f'{KS}{KB}functions.get_weather:0{KA}{{"city": "Paris", "days": 3}}{KC}'
        f'{KB} functions.search:1 {KA}{{"q": "x"}}{KC}{KE}')
QC = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
      "</parameter>\n</function>\n</tool_call>")
QC2 = ("<tool_call>\n<function=search>\n<parameter=q>\nif a < b:\n    print('<tool_call>')\n</parameter>\n"
       '<parameter=filters>\n{"lang": "fr"}\n</parameter>\n<parameter=exact>\nfalse\n</parameter>\n</function>\n'
       "</tool_call>")


def run(parser, chunks: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    text, calls = [], []
    for p in [p for c in chunks for p in parser.feed(c)] + parser.finish():
        text.append(p.text) if p.call is None else calls.append((p.call.name, json.loads(p.call.arguments)))
    return "".join(text), calls


def test_deepseek_v3_and_v31_forms() -> None:
    text, calls = run(DeepSeekV3ToolParser(NAMES), ["Let me check.\n\n" + DS_V3])
    assert text == "Let me check."
    assert calls == [("get_weather", {"city": "Paris", "days": 3}), ("search", {"q": "x", "exact": True})]
    text, calls = run(DeepSeekV3ToolParser(NAMES), [DS_V31 + "\n"])
    assert text == "" and calls == [("get_weather", {"city": "Rome"}), ("search", {"q": "y"})]
    # V3.1 arguments in a fence, and arguments encoded twice (V3's template writes a string with tojson)
    fenced = f'{B}{CB}search{SEP}```json\n{{"q": "z"}}\n```{CE}{E}'
    twice = f'{B}{CB}function{SEP}search\n```json\n{json.dumps(json.dumps({"q": "w"}))}\n```{CE}{E}'
    assert run(DeepSeekV3ToolParser(NAMES), [fenced + twice])[1] == [("search", {"q": "z"}), ("search", {"q": "w"})]


def test_a_tool_named_function_in_the_v31_form() -> None:
    text = f'{B}{CB}function{SEP}{{"x": 1}}{CE}{E}'
    assert run(DeepSeekV3ToolParser(["function"]), [text]) == ("", [("function", {"x": 1})])


def test_kimi_k2_calls_keep_the_models_ids() -> None:
    parser = KimiK2ToolParser(NAMES)
    pieces = parser.feed("Sure. " + KIMI) + parser.finish()
    assert [p.text for p in pieces if p.call is None] == ["Sure."]
    calls = [p.call for p in pieces if p.call is not None]
    assert [(c.id, c.name, json.loads(c.arguments)) for c in calls] == [
        ("functions.get_weather:0", "get_weather", {"city": "Paris", "days": 3}),
        ("functions.search:1", "search", {"q": "x"})]
    bare = f'{KS}{KB}search:4{KA}{{"q": "y"}}{KC}{KE}'   # no "functions." prefix
    (p,) = [p for p in (lambda k: k.feed(bare) + k.finish())(KimiK2ToolParser(NAMES)) if p.call]
    assert (p.call.id, p.call.name) == ("functions.search:4", "search")


def test_qwen3_coder_values_follow_the_schema() -> None:
    text, calls = run(Qwen3CoderToolParser(NAMES, SCHEMAS), ["I'll look.\n" + QC + "\n" + QC2])
    assert text == "I'll look."
    assert calls == [("get_weather", {"city": "Paris", "days": 3}),
                     ("search", {"q": "if a < b:\n    print('<tool_call>')", "filters": {"lang": "fr"},
                                 "exact": False})]
    # a value may hold the block's closing tag (code that writes it): the block ends at the one outside values
    code = ("<tool_call>\n<function=search>\n<parameter=q>\nend = '</tool_call>'\n</parameter>\n</function>\n"
            "</tool_call>")
    assert run(Qwen3CoderToolParser(NAMES, SCHEMAS), [code]) == ("", [("search", {"q": "end = '</tool_call>'"})])
    two = "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n</function>\n" \
          "<function=search>\n</function>\n</tool_call>"   # several functions in one block
    assert run(Qwen3CoderToolParser(NAMES, SCHEMAS), [two])[1] == [("get_weather", {"city": "A"}), ("search", {})]


D4 = (f'<{DSML}tool_calls>\n<{DSML}invoke name="get_weather">\n'
      f'<{DSML}parameter name="city" string="true">Paris</{DSML}parameter>\n'
      f'<{DSML}parameter name="days" string="false">3</{DSML}parameter>\n</{DSML}invoke>\n'
      f'<{DSML}invoke name="search">\n<{DSML}parameter name="q" string="true">1 < 2\nand "more"</{DSML}parameter>\n'
      f'<{DSML}parameter name="filters" string="false">{{"lang": "fr"}}</{DSML}parameter>\n'
      f'<{DSML}parameter name="exact" string="false">maybe</{DSML}parameter>\n</{DSML}invoke>\n</{DSML}tool_calls>')


def test_deepseek_v4_values_follow_the_string_attribute() -> None:
    """``string="true"``: the text as it is (``<``, quotes, newlines); ``"false"``: JSON, else the text typed by the
    schema (a boolean property's ``maybe`` is not JSON: it stays text)."""
    text, calls = run(DeepSeekV4ToolParser(NAMES, SCHEMAS), ["Checking.\n\n" + D4])
    assert text == "Checking."
    assert calls == [("get_weather", {"city": "Paris", "days": 3}),
                     ("search", {"q": '1 < 2\nand "more"', "filters": {"lang": "fr"}, "exact": "maybe"})]
    literal = D4.replace('name="days" string="false">3<', 'name="days" string="true">3<')
    assert run(DeepSeekV4ToolParser(NAMES, SCHEMAS), [literal])[1][0] == ("get_weather", {"city": "Paris", "days": "3"})


#: DeepSeek-V3.2: V4's invokes in a function_calls block
D32 = D4.replace(f"{DSML}tool_calls>", f"{DSML}function_calls>")


def test_deepseek_v32_reads_v4_invokes_in_a_function_calls_block() -> None:
    """The same calls as V4's from a ``function_calls`` block, whole or in any split; each parser leaves the other
    version's block as text."""
    want = run(DeepSeekV4ToolParser(NAMES, SCHEMAS), ["Checking.\n\n" + D4])
    assert want[1] and run(DeepSeekV32ToolParser(NAMES, SCHEMAS), ["Checking.\n\n" + D32]) == want
    assert run(DeepSeekV32ToolParser(NAMES, SCHEMAS), list("Checking.\n\n" + D32)) == want   # one character a delta
    assert run(DeepSeekV32ToolParser(NAMES, SCHEMAS), [D4]) == (D4, [])
    assert run(DeepSeekV4ToolParser(NAMES, SCHEMAS), [D32]) == (D32, [])
    assert format_calls_as("deepseek_v32", CALLS).startswith(f"<{DSML}function_calls>\n<{DSML}invoke name=")


BARE = "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>"


def test_qwen3_coder_function_without_the_wrapper() -> None:
    """A model that drops <tool_call> still calls; only a well-formed function of a request tool counts."""
    assert run(Qwen3CoderToolParser(NAMES, SCHEMAS), ["Sure.\n" + BARE + "\n" + QC]) == \
        ("Sure.", [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Paris", "days": 3})])


def test_a_reply_of_calls_only_has_no_text() -> None:
    for fmt, call in (("deepseek_v3", DS_V3), ("kimi_k2", KIMI), ("qwen3_coder", QC)):
        text, calls = run(PARSERS[fmt](NAMES, SCHEMAS), ["\n" + call + "\n\n"])
        assert text == "" and calls, fmt


@pytest.mark.parametrize("fmt,raw", [
    ("deepseek_v3", f"DeepSeek writes {B} before calls."),
    ("deepseek_v3", f'{B}{CB}rm_rf{SEP}{{"path": "/"}}{CE}{E}'),                      # unknown tool
    ("deepseek_v3", f'{B}{CB}search{SEP}{{"q": "x"}}{CE}{CB}rm_rf{SEP}{{}}{CE}{E}'),  # one unknown: all text
    ("deepseek_v3", f'{B}{CB}search{SEP}["x"]{CE}{E}'),                              # arguments not an object
    ("deepseek_v3", f'{B}{CB}search{SEP}{{"q": "x"{CE}{E}'),                         # broken JSON
    ("deepseek_v3", f'{B}{CB}search{SEP}{{"q": "x"}}{E}'),                           # call never closed
    ("deepseek_v3", f'{B}{CB}search{SEP}{{"q": "x"}}{CE}'),                          # section never closed
    ("deepseek_v3", f"{B}{E}"),                                                      # empty section
    ("deepseek_v3", f'{B}{CB}search{SEP}{{"q": "x"}}{CE} stray {E}'),
    ("kimi_k2", f"Kimi writes {KS} first."),
    ("kimi_k2", f'{KS}{KB}functions.rm_rf:0{KA}{{}}{KC}{KE}'),
    ("kimi_k2", f'{KS}{KB}tool_call_1{KA}{{"q": "x"}}{KC}{KE}'),                      # an id without a name
    ("kimi_k2", f'{KS}{KB}functions.search:0{KA}"{{q: x}}"{KC}{KE}'),                 # not a JSON object
    ("kimi_k2", f'{KS}{KB}functions.search:0{KA}{{"q": "x"}}{KC}'),
    ("kimi_k2", f"{KS}{KE}"),
    ("qwen3_coder", "Qwen writes <tool_call> tags."),
    ("qwen3_coder", "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=search>\n<parameter=q>\nx\n</function>\n</tool_call>"),  # unclosed param
    ("qwen3_coder", "<tool_call>\n<function=search>\n<parameter=q>\nx\n</parameter>\n</tool_call>"),  # no </function>
    ("qwen3_coder", "<tool_call>\n<function=search>\n<parameter=q>x</parameter><parameter=q>y</parameter>"
                    "</function></tool_call>"),                                                    # key twice
    ("qwen3_coder", '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>'),  # Hermes JSON: not this format
    ("qwen3_coder", "<tool_call>\n<function=search>\n</function>\nstray\n</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=search>\n</function>"),
    ("qwen3_coder", "<tool_call>\n</tool_call>"),
    ("qwen3_coder", "Write <function=name> then </function>."),                       # a mention
    ("qwen3_coder", "<function=rm_rf>\n<parameter=path>\n/\n</parameter>\n</function>"),  # bare, unknown tool
    ("qwen3_coder", "<function=get_weather\n<parameter=city>x</parameter></function>"),   # no '>' after the name
    ("qwen3_coder", "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"),    # bare, never closed
    ("deepseek_v4", f"V4 writes <{DSML}tool_calls> blocks."),                          # a mention
    ("deepseek_v4", D4.replace('"search"', '"rm_rf"')),                                 # one unknown: all text
    ("deepseek_v4", D4.replace('string="false">3<', 'string="no">3<')),                  # a bad attribute
    ("deepseek_v4", D4.replace(f"</{DSML}invoke>\n</{DSML}tool_calls>", f"</{DSML}tool_calls>")),  # invoke unclosed
    ("deepseek_v4", D4.replace(f"</{DSML}tool_calls>", "")),                             # block never closed
    ("deepseek_v4", f"<{DSML}tool_calls>\n</{DSML}tool_calls>"),                          # empty block
    ("deepseek_v4", D4.replace('name="city"', 'name="days"')),                          # a key twice
    ("deepseek_v32", f"V3.2 writes <{DSML}function_calls> blocks."),                   # a mention
    ("deepseek_v32", D32.replace('"search"', '"rm_rf"')),                               # one unknown: all text
    ("deepseek_v32", D32.replace(f"</{DSML}function_calls>", "")),                       # block never closed
])
def test_text_that_is_not_a_call_is_never_swallowed(fmt: str, raw: str) -> None:
    assert run(PARSERS[fmt](NAMES, SCHEMAS), [raw]) == (raw, [])


_PIECES = {
    "deepseek_v3": [DS_V3, DS_V31, B, E, CB, CE, SEP, "function", "search", '{"q": "x"}', "```json\n", "```", "\n",
                    " ", "hi", "<", "<\uff5c", "é🙂", "get_weather"],
    "kimi_k2": [KIMI, KS, KE, KB, KA, KC, "functions.search:0", "functions.", ":1", '{"q": "x"}', "<|", "<|tool_",
                "\n", " ", "hi", "é🙂"],
    "deepseek_v4": [D4, f"<{DSML}tool_calls>", f"</{DSML}tool_calls>", f'<{DSML}invoke name="search">',
                    f"</{DSML}invoke>", f'<{DSML}parameter name="q" string="true">', f"</{DSML}parameter>", "<\uff5c",
                    "\n", " ", "x", "<", "é🙂", "search"],
    "deepseek_v32": [D32, D4, f"<{DSML}function_calls>", f"</{DSML}function_calls>", f'<{DSML}invoke name="search">',
                     f"</{DSML}invoke>", f'<{DSML}parameter name="q" string="true">', f"</{DSML}parameter>",
                     "<\uff5c", "\n", " ", "x", "<", "é🙂", "search"],
    "qwen3_coder": [QC, QC2, BARE, "<tool_call>", "</tool_call>", "<function=search>", "</function>", "<parameter=q>",
                    "</parameter>", "<function=", "\n", " ", "x", "<", "é🙂", "<tool_", "call>"],
}


def _chunkings(fmt: str, pieces: list[str], cuts: list[int]) -> None:
    text = "".join(pieces)
    whole = run(PARSERS[fmt](NAMES, SCHEMAS), [text])
    bounds = sorted({min(c, len(text)) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)])]
    assert run(PARSERS[fmt](NAMES, SCHEMAS), chunks) == whole
    assert run(PARSERS[fmt](NAMES, SCHEMAS), list(text)) == whole
    if not whole[1]:  # no call: the text comes back exactly
        assert whole[0] == text


_CUTS = st.lists(st.integers(0, 700), max_size=8)


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(_PIECES["deepseek_v3"]), max_size=12), cuts=_CUTS)
def test_deepseek_v3_any_chunking_gives_the_same_calls_and_text(pieces: list[str], cuts: list[int]) -> None:
    _chunkings("deepseek_v3", pieces, cuts)


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(_PIECES["kimi_k2"]), max_size=12), cuts=_CUTS)
def test_kimi_k2_any_chunking_gives_the_same_calls_and_text(pieces: list[str], cuts: list[int]) -> None:
    _chunkings("kimi_k2", pieces, cuts)


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(_PIECES["qwen3_coder"]), max_size=12), cuts=_CUTS)
def test_qwen3_coder_any_chunking_gives_the_same_calls_and_text(pieces: list[str], cuts: list[int]) -> None:
    _chunkings("qwen3_coder", pieces, cuts)


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(_PIECES["deepseek_v4"]), max_size=12), cuts=_CUTS)
def test_deepseek_v4_any_chunking_gives_the_same_calls_and_text(pieces: list[str], cuts: list[int]) -> None:
    _chunkings("deepseek_v4", pieces, cuts)


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(_PIECES["deepseek_v32"]), max_size=12), cuts=_CUTS)
def test_deepseek_v32_any_chunking_gives_the_same_calls_and_text(pieces: list[str], cuts: list[int]) -> None:
    _chunkings("deepseek_v32", pieces, cuts)


@pytest.mark.parametrize("fmt,call", [("deepseek_v3", DS_V31), ("qwen3_coder", QC), ("deepseek_v32", D32)])
def test_reasoning_then_calls(fmt: str, call: str) -> None:
    """DeepSeek-R1 / V3.1 and Qwen3.5 think first (the prompt opened <think>), then call."""
    cfg = TurnConfig(reasoning=True, starts_in_reasoning=True, tool_names=NAMES, tool_parser=fmt,
                     tool_schemas=SCHEMAS)
    res = whole_turn(cfg, "\nThe user wants weather.\n</think>\n\nOne moment." + call, "stop")
    assert res.reasoning == "The user wants weather." and res.content == "One moment."
    assert res.calls and res.calls[0].name == "get_weather" and res.finish_reason == "tool_calls"


CALLS = [{"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                            "arguments": '{"city": "Paris", "days": 3}'}},
         {"id": "functions.search:7", "type": "function", "function": {"name": "search", "arguments": {"q": "a<b"}}}]


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_earlier_calls_render_as_markup_the_parser_reads(fmt: str) -> None:
    block = format_calls_as(fmt, CALLS)
    assert run(PARSERS[fmt](NAMES, SCHEMAS), [block]) == ("", [("get_weather", {"city": "Paris", "days": 3}),
                                                               ("search", {"q": "a<b"})])


def test_kimi_rendering_keeps_kimi_ids_and_numbers_others() -> None:
    block = format_calls_as("kimi_k2", CALLS)
    assert "functions.get_weather:0" in block and "functions.search:7" in block and "call_1" not in block
    assert block.count(KS) == 1 and block.count(KB) == 2   # one section for the turn's calls
    assert format_calls_as("deepseek_v3", CALLS).count(B) == 1


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_fallback_teaches_and_shows_the_served_format(fmt: str) -> None:
    from ferrylm.server.text.tools import ToolSpec, fallback_messages

    specs = [ToolSpec("get_weather", "", SCHEMAS["get_weather"])]
    out = fallback_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Checking.",
                                                               "tool_calls": CALLS}], specs, fmt)
    assert PARSERS[fmt].OPEN in out[0]["content"] and '{"name": <function name>' not in out[0]["content"]
    assert out[2]["content"] == "Checking.\n" + format_calls_as(fmt, CALLS)


DS_V31_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}<\uff5cUser\uff5c>{{ m.content }}"
                   "{% endif %}{% endfor %}{% if tools %}" + B + CB + "{% endif %}<\uff5cAssistant\uff5c>"
                   "{% if thinking %}<think>{% else %}</think>{% endif %}")
QWEN3_CODER_TEMPLATE = ("{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>\\n<function=example>"
                        "\\n<parameter=x>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>")
HERMES_TEMPLATE = ('{{- "<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n'
                   '</tool_call>" }}')


def test_choice_of_parser() -> None:
    assert {"deepseek_v3", "kimi_k2", "qwen3_coder"} <= set(TOOL_PARSERS.names)
    assert choose_tool_parser("auto", "DeepseekV3ForCausalLM") == "deepseek_v3"
    assert choose_tool_parser("auto", "DeepseekV3ForCausalLM", None, "kimi_k2") == "kimi_k2"
    assert choose_tool_parser(None, "Qwen3NextForCausalLM") == "qwen3_coder"
    assert choose_tool_parser(None, "Qwen3_5MoeForCausalLM") == "qwen3_coder"
    assert choose_tool_parser(None, "DeepseekV4ForCausalLM") == "deepseek_v4"
    assert choose_tool_parser(None, "DeepseekV32ForCausalLM") == "deepseek_v32"
    assert choose_tool_parser("auto", "DeepseekV3ForCausalLM", None, "deepseek_v32") == "deepseek_v32"
    # a template writing DSML function_calls is V3.2's, DSML tool_calls (the built-in V4 template) V4's
    assert choose_tool_parser("auto", None, "{{ '<' ~ '\uff5cDSML\uff5c' ~ 'function_calls>' }}") == "deepseek_v32"
    from ferrylm.server.text.builtin_templates import template_for
    assert choose_tool_parser("auto", None, template_for("deepseek_v4")) == "deepseek_v4"
    assert choose_tool_parser(None, "Qwen4ExpForCausalLM") == "qwen3_coder"
    # the template's markup first: a Kimi template on a DeepSeek architecture, DeepSeek's own tokens
    kimi_tpl = "{% for c in m.tool_calls %}<|tool_call_begin|>{{ c.id }}{% endfor %}"
    assert choose_tool_parser("auto", "DeepseekV3ForCausalLM", kimi_tpl) == "kimi_k2"
    assert choose_tool_parser("auto", "LlamaForCausalLM", DS_V31_TEMPLATE) == "deepseek_v3"
    assert choose_tool_parser("auto", "Qwen3MoeForCausalLM", QWEN3_CODER_TEMPLATE) == "qwen3_coder"
    # a Qwen3-Next checkpoint whose template teaches Hermes JSON calls keeps Hermes
    assert choose_tool_parser("auto", "Qwen3NextForCausalLM", HERMES_TEMPLATE) == "hermes"
    assert choose_tool_parser("auto", "Qwen3NextForCausalLM", "{{ messages }}") == "qwen3_coder"
    # Llama 3.1's <function=name>{json}</function> prompts are not Qwen3-Coder's
    assert choose_tool_parser("auto", "LlamaForCausalLM", "<function=example_function_name>{...}</function>") == \
        "hermes"
    assert choose_tool_parser("kimi_k2", "Qwen3NextForCausalLM", QWEN3_CODER_TEMPLATE) == "kimi_k2"  # flag wins
    assert choose_tool_parser("deepseek_v31") == "deepseek_v3" and choose_tool_parser("qwen3_xml") == "qwen3_coder"
    for name in PARSERS:
        assert type(make_tool_parser(name, NAMES, SCHEMAS)) is PARSERS[name]
