"""Admission over HTTP with a tiny KV pool: what can never fit is rejected at once; what fits is served."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import start_server, stop_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small_pool_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("pool"), "--model", "smollm2-135m", "--num-tokens", "64",
                       "--page-size", "16")
    yield srv
    stop_server(srv)


def test_prompt_larger_than_pool_is_400_and_next_is_served(small_pool_server):
    url = f"{small_pool_server.base_url}/v1/completions"
    big = httpx.post(url, json={"model": "smollm2-135m", "prompt": list(range(100, 200)), "max_tokens": 4},
                     timeout=10)
    assert big.status_code == 400
    err = big.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert err["message"].startswith("This model's maximum context length is 8192 tokens.")
    assert "100 tokens" in err["message"] and "64 tokens" in err["message"] and "--num-tokens" in err["message"]
    small = httpx.post(url, json={"model": "smollm2-135m", "prompt": list(range(100, 120)), "max_tokens": 4,
                                  "temperature": 0}, timeout=60)
    assert small.status_code == 200, small.text
    assert small.json()["usage"] == {"prompt_tokens": 20, "completion_tokens": 4, "total_tokens": 24,
                                     "prompt_tokens_details": {"cached_tokens": 0}}
