"""The engine's grammar hook (llguidance masks on the batched logits) and prompt logprobs, on the fake model."""

from __future__ import annotations

import json

import pytest
import torch

from ferrylm.config import EngineConfig
from ferrylm.engine.boot import engine_for_model
from ferrylm.engine.engine import Engine
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.engine.structured import unpack_bitmask
from ferrylm.server.text.structured import choice_grammar, json_schema_grammar
from ferrylm.server.text.tokenizer import TextCodec
from tests.engine.fake_model import FakeModel, fake_config
from tests.server.conftest import build_tiny_tokenizer, qwen_codec  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def make(vocab: int, tokenizer=None, budget: int = 64, eos: int = 0) -> Engine:
    cfg = fake_config(vocab=vocab, eos=eos)
    ec = EngineConfig(device="cpu", num_pages=64, page_size=4, max_running_requests=8, max_prefill_length=budget,
                      check_invariants=True)
    return engine_for_model(FakeModel(cfg), cfg, ec, device=torch.device("cpu"), dtype=torch.float32,
                            tokenizer_path=None if tokenizer is None else str(tokenizer))


def run(engine: Engine, reqs: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    for rid, (p, params) in reqs.items():
        engine.add_request(rid, p, params)
    outs: dict[str, list] = {rid: [] for rid in reqs}
    for _ in range(2000):
        if not engine.has_work():
            break
        for o in engine.step():
            outs[o.request_id].append(o)
    return outs


def test_unpack_bitmask() -> None:
    bm = torch.tensor([[0b101, -1]], dtype=torch.int32)
    got = unpack_bitmask(bm, 40)
    assert got.shape == (1, 40) and got[0, :3].tolist() == [True, False, True] and not got[0, 3:32].any()
    assert got[0, 32:].all()


def test_grammar_constrains_only_its_row(tok_dir) -> None:
    codec = TextCodec.from_pretrained(tok_dir)
    eos = codec.eos_token_ids[0]
    prompt = codec.encode("Hello world")
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = run(make(codec.vocab_size, tok_dir, eos=eos), {"free": (prompt, free)})["free"]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    reqs = {"choice": (prompt, SamplingParams(temperature=0.0, max_tokens=20,
                                              grammar=choice_grammar(["yes", "no way"], "c"))),
            "json": (prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=40,
                                            grammar=json_schema_grammar(schema, "s"))),
            "free": (prompt, free)}
    outs = run(make(codec.vocab_size, tok_dir, eos=eos), reqs)
    ids = {k: [t for o in v for t in o.new_token_ids] for k, v in outs.items()}
    assert outs["choice"][-1].finish_reason == "stop" and ids["choice"][-1] == eos
    assert codec.decode(ids["choice"][:-1]) in ("yes", "no way")
    assert outs["json"][-1].finish_reason == "stop"
    assert json.loads(codec.decode(ids["json"][:-1]))["ok"] in (True, False)
    assert ids["free"] == [t for o in alone for t in o.new_token_ids]   # the unconstrained row is untouched


def test_a_grammar_without_a_tokenizer_is_refused() -> None:
    out = run(make(32), {"r": ([1, 2, 3], SamplingParams(max_tokens=2, grammar=choice_grammar(["a"], "c")))})["r"]
    assert out[0].error_code == "invalid_request" and "tokenizer" in out[0].error_message


def test_prompt_logprobs_exact_and_chunking_invariant(monkeypatch) -> None:
    vocab = 16
    prompt = [3, 7, 1, 9, 4, 12, 5, 2, 8, 11]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=2)
    whole = run(make(vocab), {"r": (prompt, params)})["r"][0].prompt_logprobs
    from ferrylm.engine import prompt_logprobs

    monkeypatch.setattr(prompt_logprobs, "ROWS_PER_BLOCK", 2)   # logits a block of rows at a time
    chunked = run(make(vocab, budget=3), {"r": (prompt, params)})["r"][0].prompt_logprobs
    assert whole[0] is None and len(whole) == len(prompt)
    for a, b, tok in zip(whole[1:], chunked[1:], prompt[1:]):
        assert a.token_id == b.token_id == tok and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert len(a.top) == 2 and a.top[0][1] >= a.top[1][1] and 1 <= a.rank <= vocab
        assert (a.rank == 1) == (a.top[0][0] == tok)
    # oracle: the full distribution after prompt[:i] (logprobs = the whole vocabulary) holds prompt[i]'s logprob
    for i in (1, 5, 9):
        o = run(make(vocab), {"o": (prompt[:i], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                                               logprobs=vocab))})["o"][0]
        dist = dict(o.logprobs[0].top)
        assert whole[i].logprob == pytest.approx(dist[prompt[i]], abs=1e-5)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}]


def test_forced_tool_call_through_the_engine(tok_dir) -> None:
    from ferrylm.server.text.tool_parsers.hermes import HermesToolParser
    from ferrylm.server.text.tools import ToolChoice, parse_openai_tools, tag_terms, tool_call_grammar

    codec = TextCodec.from_pretrained(tok_dir)
    eos = codec.eos_token_ids[0]
    g = tool_call_grammar(parse_openai_tools(TOOLS), ToolChoice("named", "get_weather", parallel=False),
                          tags=tag_terms(codec))
    outs = run(make(codec.vocab_size, tok_dir, eos=eos), {
        "t": (codec.encode("Hello"), SamplingParams(temperature=1.0, seed=3, max_tokens=200, grammar=g))})["t"]
    ids = [t for o in outs for t in o.new_token_ids]
    assert outs[-1].finish_reason == "stop" and ids[-1] == eos
    parser = HermesToolParser(["get_weather"])
    pieces = parser.feed(codec.decode(ids[:-1])) + parser.finish()
    (call,) = [p.call for p in pieces if p.call is not None]
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")


def test_tool_tags_are_single_tokens_in_qwen3_vocabulary(qwen_codec) -> None:
    """Qwen's <tool_call> is one added token (151657): the forcing grammar must accept exactly the tokens the
    model writes, not the tag spelled out in characters."""
    from ferrylm.engine.structured import StructuredDecoder
    from ferrylm.server.text.tools import ToolChoice, parse_openai_tools, tag_terms, tool_call_grammar

    assert tag_terms(qwen_codec) == ("<[151657]>", "<[151658]>")
    g = tool_call_grammar(parse_openai_tools(TOOLS), ToolChoice("required"), tags=tag_terms(qwen_codec))
    sd = StructuredDecoder(qwen_codec.name_or_path, 151936, [151645])

    class R:
        request_id, grammar, params = "q", None, SamplingParams(grammar=g)

    r = R()
    sd.attach(r)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    for t in qwen_codec.encode(text, add_special_tokens=False) + [151645]:
        logits = torch.zeros(1, 151936)
        sd.mask_logits(logits, [r])
        assert logits[0, t] == 0 and torch.isinf(logits).sum() > 151000, qwen_codec.token_text(t)
        sd.advance(r, t)
        assert r.grammar is not None


def test_prompt_logprobs_and_grammar_cross_the_ipc() -> None:
    from ferrylm.engine import ipc
    from ferrylm.engine.outputs import EngineOutput, TokenLogprob

    out = EngineOutput("r", [5], prompt_logprobs=[None, TokenLogprob(3, -1.25, [(3, -1.25), (4, -2.0)], rank=1)])
    back = ipc.decode(ipc.encode(ipc.Outputs([out]))).outputs[0]
    assert back.prompt_logprobs == out.prompt_logprobs
    p = SamplingParams(grammar=choice_grammar(["a", "b"], "c"), prompt_logprobs=3)
    msg = ipc.decode(ipc.encode(ipc.AddRequest("r", [1], p.to_dict())))
    assert SamplingParams.from_dict(msg.params) == p


def test_a_complete_grammar_ends_the_request_before_min_tokens(tok_dir) -> None:
    """min_tokens bans EOS only while the output grammar can go on: a choice that is complete after 3 tokens ends
    with finish_reason stop (it used to end with grammar_failed); a regex that can go on is held to min_tokens; the
    other request of the batch is untouched and the engine keeps serving."""
    from ferrylm.server.text.structured import regex_grammar

    codec = TextCodec.from_pretrained(tok_dir)
    eos = codec.eos_token_ids[0]
    prompt = codec.encode("Hello world")
    eng = make(codec.vocab_size, tok_dir, eos=eos)
    outs = run(eng, {"g": (prompt, SamplingParams(temperature=0.0, max_tokens=30, min_tokens=8,
                                                  grammar=choice_grammar(["yes"], "c"))),
                     "re": (prompt, SamplingParams(temperature=0.0, max_tokens=30, min_tokens=5,
                                                   grammar=regex_grammar("a+", "r"))),
                     "free": (prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))})
    assert outs["g"][-1].finish_reason == "stop" and outs["g"][-1].error_code is None, outs["g"]
    ids = [t for o in outs["g"] for t in o.new_token_ids]
    assert ids[-1] == eos and codec.decode(ids[:-1]) == "yes"
    re_ids = [t for o in outs["re"] for t in o.new_token_ids]
    assert outs["re"][-1].error_code is None and len(re_ids) >= 5
    assert set(codec.decode([t for t in re_ids if t != eos])) == {"a"}
    assert outs["free"][-1].finish_reason == "length"
    assert not eng.requests and eng.pool.allocator.num_used == 0


def test_a_grammar_matching_nothing_ends_the_request_with_an_error(tok_dir) -> None:
    import llguidance

    codec = TextCodec.from_pretrained(tok_dir)
    grammar = llguidance.LLMatcher.grammar_from_json_schema({"$ref": "#"})   # bypasses the frontend's check
    out = run(make(codec.vocab_size, tok_dir, eos=codec.eos_token_ids[0]),
              {"r": (codec.encode("Hi"), SamplingParams(temperature=0.0, max_tokens=20, grammar=grammar))})["r"]
    assert out[-1].error_code == "grammar_failed", out
