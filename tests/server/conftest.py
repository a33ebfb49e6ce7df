"""Fixtures for the HTTP frontend tests: a tiny byte-level BPE tokenizer folder, a scripted fake engine, and an
ASGI client. Nothing here needs a network, a GPU or torch."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable

import httpx
import pytest

from ferrylm.engine.outputs import EngineOutput, TokenLogprob
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.server.api.app import create_app
from ferrylm.server.process.engine_client import HealthState, ModelInfo
from ferrylm.server.text.tokenizer import TextCodec

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def _find_qwen3_tokenizer() -> Path:
    """``$FERRYLM_TEST_TOKENIZER``, else ``shared/data/qwen3-tokenizer`` beside the checkout or beside any folder
    above it (a git worktree under ``wt/NAME`` finds the one beside the main checkout)."""
    import os

    env = os.environ.get("FERRYLM_TEST_TOKENIZER")
    if env:
        return Path(env)
    for parent in PROJECT_ROOT.parents:
        cand = parent / "shared" / "data" / "qwen3-tokenizer"
        if (cand / "tokenizer.json").is_file():
            return cand
    return PROJECT_ROOT.parent / "shared" / "data" / "qwen3-tokenizer"


QWEN3_TOKENIZER = _find_qwen3_tokenizer()

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'tool' and not m.tool_call_id %}{{ raise_exception('tool messages need a tool_call_id') }}"
    "{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SERVED = "tiny-model"
SCRIPT_TEXT = "Hello world! Stop here. 世界 🙂 done."


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def build_tiny_tokenizer(folder: Path, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """A byte-level BPE with ~400 ids trained on English only, so CJK and emoji split into byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["Hello world! The quick brown fox jumps over the lazy dog.", "Stop here. done. user assistant",
              "system: you are a helpful assistant. Say hello to the world."] * 50
    tok.train_from_iterator(corpus, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                              "pad_token": "<|endoftext|>", "clean_up_tokenization_spaces": False,
                              "model_max_length": 256}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="session")
def codec(tiny_tokenizer_dir: Path) -> TextCodec:
    return TextCodec.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def harmony_codec(tmp_path_factory: pytest.TempPathFactory) -> TextCodec:
    """A gpt-oss tokenizer (o200k_harmony, built from the vocabulary litellm ships: tests/server/harmony_vocab.py),
    loaded as the server loads it."""
    from .harmony_vocab import build_harmony_tokenizer, o200k_file

    if o200k_file() is None:
        pytest.skip("o200k_base.tiktoken not found in the litellm package (the dev extras install it)")
    from ferrylm.server.text.harmony import load_codec

    return load_codec(build_harmony_tokenizer(tmp_path_factory.mktemp("gpt-oss-tokenizer")))


@pytest.fixture(scope="session")
def qwen_codec() -> TextCodec:
    if not (QWEN3_TOKENIZER / "tokenizer.json").is_file():
        pytest.skip(f"real Qwen3 tokenizer not found at {QWEN3_TOKENIZER} (../shared/data/qwen3-tokenizer)")
    return TextCodec.from_pretrained(QWEN3_TOKENIZER)


Script = Callable[[str, list[int], SamplingParams], Iterable[int]]


class FakeEngine:
    """A deterministic :class:`EngineClient`.

    Each request emits ``script(request_id, prompt_ids, params)`` one token per step (default: SCRIPT_TEXT then
    EOS), finishing with "stop" on EOS or one of ``params.stop_token_ids``, or "length" at max_tokens. Knobs:
    ``refuse_exc`` (raised by ``check_admission``: a refusal before the engine sees the request), ``prefill_delay``
    (seconds before the first output: a long prefill), ``start_exc`` (raised after admission, before the first
    output: a failure in the queue or the prefill), ``fail_at``/``fail_exc`` (raised before output number
    ``fail_at``), ``delay`` (seconds per step),
    ``health_status``, ``queue_time`` (sent on the first output, as the engine does), ``prefix_pages`` (a
    prefix cache of that page size is emulated: the first output reports the longest prefix, in whole pages and
    short of the last token, shared with an earlier prompt, as ``num_cached_tokens``). Records ``requests``,
    ``aborts`` (explicit abort calls) and ``closed_early`` (iteration left before the request finished).
    """

    def __init__(self, codec: TextCodec, *, max_model_len: int = 256, kv_pool_tokens: int = 0,
                 script: Script | None = None, delay: float = 0.0, start_exc: BaseException | None = None,
                 fail_at: int | None = None, fail_exc: BaseException | None = None, health_status: str = "ready",
                 queue_time: float | None = 0.0, prefix_pages: int | None = None,
                 refuse_exc: BaseException | None = None, prefill_delay: float = 0.0):
        self.codec = codec
        self.eos = codec.eos_token_ids[0]
        self.model_info = ModelInfo(name="fake", path="/models/fake", max_model_len=max_model_len,
                                    kv_pool_tokens=kv_pool_tokens, eos_token_ids=(self.eos,))
        self.script = script or (lambda rid, ids, p: codec.encode(SCRIPT_TEXT, add_special_tokens=False) + [self.eos])
        self.delay = delay
        self.start_exc = start_exc
        self.refuse_exc = refuse_exc
        self.prefill_delay = prefill_delay
        self.fail_at = fail_at
        self.fail_exc = fail_exc
        self.health_status = health_status
        self.queue_time = queue_time
        self.prefix_pages = prefix_pages
        self.requests: list[tuple[str, list[int], SamplingParams]] = []
        self.aborts: list[str] = []
        self.closed_early: list[str] = []
        self.started = asyncio.Event()

    def health(self) -> HealthState:
        return HealthState(self.health_status, detail="" if self.health_status == "ready" else "fake says so")

    def check_admission(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if self.refuse_exc is not None:
            raise self.refuse_exc

    async def abort(self, request_id: str) -> None:
        self.aborts.append(request_id)

    def _cached(self, ids: list[int]) -> int | None:
        if self.prefix_pages is None:
            return None
        best = 0
        for _, prev, _ in self.requests:
            n = 0
            while n < min(len(prev), len(ids) - 1) and prev[n] == ids[n]:
                n += 1
            best = max(best, n // self.prefix_pages * self.prefix_pages)
        return best

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[EngineOutput]:
        cached = self._cached(list(prompt_token_ids))
        self.requests.append((request_id, list(prompt_token_ids), params))
        self.started.set()
        await asyncio.sleep(self.prefill_delay)
        if self.start_exc is not None:
            raise self.start_exc
        finished = False
        try:
            for i, tok in enumerate(self.script(request_id, list(prompt_token_ids), params)):
                await asyncio.sleep(self.delay)
                if self.fail_at is not None and i == self.fail_at:
                    raise self.fail_exc or RuntimeError("fake failure")
                finish = None
                if (tok == self.eos or tok in params.stop_token_ids) and not params.ignore_eos:
                    finish = "stop"
                elif params.max_tokens is not None and i + 1 >= params.max_tokens:
                    finish = "length"
                lps = None
                if params.logprobs is not None:
                    top = [(tok, -0.25), ((tok + 1) % self.codec.vocab_size, -1.5), (0, -3.0)][:params.logprobs]
                    lps = [TokenLogprob(tok, -0.25, top)]
                finished = finish is not None
                plps = None
                if i == 0 and params.prompt_logprobs is not None:   # fake numbers: -0.5 per prompt token
                    k = params.prompt_logprobs
                    plps = [None] + [TokenLogprob(t, -0.5, [(t, -0.5), (0, -2.0)][:k], rank=1)
                                     for t in prompt_token_ids[1:]]
                yield EngineOutput(request_id, [tok], finish, lps, num_prompt_tokens=len(prompt_token_ids),
                                   queue_time=self.queue_time if i == 0 else None, prompt_logprobs=plps,
                                   num_cached_tokens=cached if i == 0 else None)
                if finished:
                    return
        finally:
            if not finished:
                self.closed_early.append(request_id)


def endless(codec: TextCodec, text: str = "la ") -> Script:
    """A script that never ends on its own (for disconnect tests)."""
    ids = codec.encode(text, add_special_tokens=False)
    return lambda rid, p, params: itertools.cycle(ids)


@pytest.fixture
def engine(codec: TextCodec) -> FakeEngine:
    return FakeEngine(codec)


def make_client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                             base_url="http://test")


@pytest.fixture
async def client(engine: FakeEngine, codec: TextCodec) -> AsyncIterator[httpx.AsyncClient]:
    async with make_client(create_app(engine, codec, SERVED)) as c:
        yield c


def parse_sse(text: str) -> list[Any]:
    """Split an SSE body into decoded JSON events plus the final "[DONE]" (keep-alive comments, ``: ping``,
    skipped); assert the framing on the way."""
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = []
    for block in text.split("\n\n")[:-1]:
        if block == ": ping":
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events


def assert_error(resp: httpx.Response, status: int, *, param: str | None = None, code: str | None = None) -> dict:
    """Check an OpenAI-shaped error response; return its ``error`` dict."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err
