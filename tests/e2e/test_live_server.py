"""The main job end to end: ``ferry serve`` with the default built-in model, driven by the real openai SDK."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from ferrylm.checkpoints.resolve import resolve_model
from ferrylm.server.text.tokenizer import TextCodec
from tests.e2e.conftest import free_port

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(default_server):
    return openai.OpenAI(base_url=f"{default_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_health_goes_503_then_200(default_server):
    assert 503 in default_server.health_codes, default_server.health_codes  # loading
    assert default_server.health_codes[-1] == 200
    body = httpx.get(f"{default_server.base_url}/health").json()
    assert body["status"] == "ready"


def test_start_says_loading_first_shows_phases_in_order_and_ends_with_one_ready_line(default_server):
    """Issue 43 item 3: "loading MODEL ..." before uvicorn's lines, the boot's phases in order while loading, one
    short ready line (no readiness dict at INFO)."""
    log = default_server.log()
    lines = log.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("loading smollm2-moe ..."))
    uvicorn = next(i for i, line in enumerate(lines) if "Uvicorn running on" in line or "startup complete" in line)
    phases = [next(i for i, line in enumerate(lines) if line == f"  {p} ...") for p in ("reading weights",
                                                                                         "warming up")]
    ready = [line for line in lines if line.startswith("ready: ")]
    assert first < uvicorn and first < phases[0] < phases[1]
    assert ready == [f"ready: http://127.0.0.1:{default_server.port} (smollm2-moe, 8192-token context)"], ready
    assert lines.index(ready[0]) > phases[1]
    assert "engine ready: {" not in log and "capturing graphs" not in log   # no GPU here: no graphs


def test_models_lists_default(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["smollm2-moe"]


def test_paris_non_stream_and_stream_agree(client):
    resp = client.chat.completions.create(model="smollm2-moe", messages=QUESTION, temperature=0, max_tokens=32)
    text = resp.choices[0].message.content
    assert "Paris" in text
    assert resp.choices[0].finish_reason in ("stop", "length")
    # usage counts match the tokenizer
    codec = TextCodec.from_pretrained(resolve_model("smollm2-moe").path)
    prompt_ids = codec.apply_chat_template(QUESTION, add_generation_prompt=True)
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    gen_ids = codec.encode(text, add_special_tokens=False)
    # completion tokens = the text's tokens, plus the EOS token when it stopped on EOS
    assert resp.usage.completion_tokens - len(gen_ids) in (0, 1)

    stream = client.chat.completions.create(model="smollm2-moe", messages=QUESTION, temperature=0, max_tokens=32,
                                            stream=True, stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            parts.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert "".join(parts) == text
    assert finish == resp.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == resp.usage.completion_tokens


def test_completions_and_stop_string(client):
    resp = client.completions.create(model="smollm2-moe", prompt="The capital of France is", temperature=0,
                                     max_tokens=8)
    assert resp.object == "text_completion" and resp.choices[0].text
    stopped = client.chat.completions.create(model="smollm2-moe", messages=QUESTION, temperature=0, max_tokens=32,
                                             stop=["Paris"])
    assert "Paris" not in stopped.choices[0].message.content
    assert stopped.choices[0].finish_reason == "stop"


def test_bad_inputs_over_http(default_server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=QUESTION)
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2-moe", messages=QUESTION, max_tokens=100_000)
    assert e.value.code == "context_length_exceeded"
    assert str(e.value.body["message"]).startswith("This model's maximum context length is 8192 tokens.")
    r = httpx.post(f"{default_server.base_url}/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(f"{default_server.base_url}/v1/chat/completions",
                   json={"model": "smollm2-moe", "messages": QUESTION, "temperature": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


def _run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ferrylm.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_missing_model_path_exits_2(tmp_path):
    r = _run_cli("serve", "--port", str(free_port()), "--model", str(tmp_path / "nope"))
    assert r.returncode == 2
    assert "does not exist" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "empty").mkdir()
    r = _run_cli("serve", "--port", str(free_port()), "--model", str(tmp_path / "empty"))
    assert r.returncode == 2 and "config.json" in r.stderr


def test_port_in_use_exits_2(default_server):
    r = _run_cli("serve", "--port", str(default_server.port))
    assert r.returncode == 2
    assert "--port" in r.stderr and "Traceback" not in r.stderr


def test_generate_cli_without_server():
    r = _run_cli("generate", "--chat", "--max-tokens", "16", "What is the capital of France?", timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout


def test_bench_serve_against_live_server(default_server, tmp_path):
    out = tmp_path / "bench.json"
    base = f"http://127.0.0.1:{default_server.port}/v1/"   # as an OpenAI SDK's base_url: the /v1 is dropped
    r = _run_cli("bench", "serve", "--base-url", base, "--concurrency", "2", "--num-prompts", "2",
                 "--input-len", "8", "--output-len", "4", "--output-json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    import json

    s = json.loads(out.read_text())
    assert s["completed"] == 2 and s["failed"] == 0
    assert s["total_output_tokens"] == 8
    assert s["request_throughput"] > 0 and s["output_throughput"] > 0
    assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"]
    assert s["itl_ms"]["p50"] > 0


def test_disconnect_mid_stream_frees_pages(default_server):
    import time

    url = f"{default_server.base_url}/v1/completions"
    body = {"model": "smollm2-moe", "prompt": "Count from one to one thousand:", "max_tokens": 2000,
            "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", url, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(x.startswith("data: ") for x in got)
            used_while_streaming = None
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not used_while_streaming:
                used_while_streaming = httpx.get(f"{default_server.base_url}/health").json()["engine"].get(
                    "kv_pages_used")
                time.sleep(0.1)
            assert used_while_streaming, "the running request holds KV pages"
        # leaving the block closes the connection mid-stream
    t0 = time.monotonic()
    while time.monotonic() - t0 < 5:
        eng = httpx.get(f"{default_server.base_url}/health").json()["engine"]
        if eng["kv_pages_used"] == 0 and eng["num_running"] == 0:
            break
        time.sleep(0.1)
    assert eng["kv_pages_used"] == 0 and eng["num_running"] == 0, eng
