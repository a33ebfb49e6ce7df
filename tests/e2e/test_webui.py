"""The web page at ``/`` in a real browser (Debian's chromium driven by Playwright) against one live ``ferry serve``
of the built-in model, started with ``--api-key`` and the offload backend (so the expert cache has misses to show).

A screenshot of each state goes to ``$FERRYLM_TEST_ARTIFACTS/webui`` (default: pytest's tmp dir; the path is
printed); docs/webui.png is the live view after a reply, copied from there by hand.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from ferrylm.memory.budget import gib

from .conftest import start_server, stop_server

pytestmark = pytest.mark.slow

KEY = "webui-test-key"
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
SETTINGS = {"system": "", "temperature": 0, "top_p": 1, "max_tokens": 12, "tools": ""}
PLAN_PARTS = {"reserve": "reserve_bytes", "weights": "weights_bytes", "workspace": "workspace_bytes",
              "kv": "kv_bytes", "experts": "expert_bytes"}


def _browser_or_skip():
    """Playwright's chromium driver on Debian's chromium; missing pieces fail in CI (the Makefile installs them)
    and skip elsewhere."""
    missing = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing = "the playwright package (pip install -e '.[dev]')"
    if missing is None and not Path(CHROMIUM).exists():
        missing = f"{CHROMIUM} (apt-get install chromium; `make test` does it)"
    if missing is not None:
        if os.environ.get("CI"):
            pytest.fail(f"missing {missing}")
        pytest.skip(f"missing {missing}")
    return sync_playwright


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("webui-serve"), "--api-key", KEY, "--moe-backend", "offload",
                       "--moe-cache-size", "64")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def browser():
    sync_playwright = _browser_or_skip()
    with sync_playwright() as p:
        # launch() gives the browser a fresh temporary user-data-dir; nothing is downloaded
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    root = os.environ.get("FERRYLM_TEST_ARTIFACTS")
    d = Path(root) / "webui" if root else tmp_path_factory.mktemp("webui-shots")
    d.mkdir(parents=True, exist_ok=True)
    print(f"web page screenshots: {d}")
    return d


def _context(browser, *, key: bool = True):
    ctx = browser.new_context(viewport={"width": 1440, "height": 900})
    init = {"ferrylm.settings": json.dumps(SETTINGS), **({"ferrylm.apiKey": KEY} if key else {})}
    ctx.add_init_script("for (const [k, v] of Object.entries(%s)) if (localStorage.getItem(k) === null) "
                        "localStorage.setItem(k, v);" % json.dumps(init))
    return ctx


@pytest.fixture
def page(browser, server):
    ctx = _context(browser)
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(server.base_url + "/")
    pg.wait_for_selector('#engine-state[data-state="ready"]', timeout=30_000)
    yield pg
    ctx.close()
    assert not errors, errors


def _send(pg, text: str) -> None:
    pg.fill("#prompt", text)
    pg.press("#prompt", "Enter")


def _wait_reply_done(pg, timeout_ms: int = 60_000) -> None:
    pg.wait_for_selector("#stop", state="hidden", timeout=timeout_ms)


def _health(server) -> dict:
    return httpx.get(f"{server.base_url}/health", timeout=10).json()


def test_api_key_is_asked_until_entered(browser, server, shots) -> None:
    ctx = _context(browser, key=False)
    pg = ctx.new_page()
    refused: list[str] = []
    pg.on("response", lambda r: refused.append(r.url) if r.status == 401 else None)
    pg.goto(server.base_url + "/")
    pg.wait_for_selector("#key-dialog[open]", timeout=10_000)
    pg.wait_for_selector('#engine-state[data-state="locked"]', timeout=10_000)
    assert any(u.endswith("/v1/models") for u in refused) and any("/v1/live" in u for u in refused), refused
    assert pg.inner_text("#model-name") != "smollm2-moe"
    pg.fill('[data-testid="key-input"]', "not-the-key")
    pg.click('[data-testid="key-save"]')
    pg.wait_for_function("document.getElementById('key-error').textContent.includes('refused')", timeout=10_000)
    pg.screenshot(path=str(shots / "1-key-refused.png"))
    pg.fill('[data-testid="key-input"]', KEY)
    pg.click('[data-testid="key-save"]')
    pg.wait_for_selector("#key-dialog", state="hidden", timeout=10_000)
    pg.wait_for_function("document.getElementById('model-name').textContent === 'smollm2-moe'", timeout=10_000)
    pg.wait_for_selector('#engine-state[data-state="ready"]', timeout=10_000)
    assert "8,192" in pg.inner_text("#model-ctx")
    ctx.close()


def test_reply_streams_survives_reload_and_shows_in_the_live_view(page, server, shots) -> None:
    page.evaluate("""() => { window.lengths = new Set();
        new MutationObserver(() => { const r = document.querySelector('.msg.assistant:last-child .body');
            if (r && document.getElementById('stop').hidden === false) window.lengths.add(r.textContent.length); })
          .observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true}); }""")
    _send(page, "What is the capital of France?")
    _wait_reply_done(page)
    reply = page.inner_text(".msg.assistant .body")
    assert reply.strip(), "no reply on the page"
    assert page.evaluate("window.lengths.size") >= 3, "the reply did not arrive in pieces"
    meta = page.inner_text('[data-testid="msg-meta"]')
    m = re.search(r"(\d+) prompt tokens \((\d+) cached\) · (\d+) completion tokens .* tok/s · finish: (stop|length)", meta)
    assert m and 1 <= int(m.group(3)) <= SETTINGS["max_tokens"], meta
    # the live view: the plan's numbers as /v1/memory has them, and a tok/s figure from the reply
    plan = httpx.get(f"{server.base_url}/v1/memory", headers={"Authorization": f"Bearer {KEY}"}).json()["plan"]
    for part, field in PLAN_PARTS.items():
        li = page.locator(f'#plan-legend li[data-part="{part}"]')
        assert int(li.get_attribute("data-bytes")) == plan[field], part
        assert li.inner_text().endswith(gib(plan[field])), (part, li.inner_text(), gib(plan[field]))
    page.wait_for_function("Number(document.getElementById('tok-s-value').dataset.peak) > 0", timeout=10_000)
    page.wait_for_selector("#heatmap canvas", timeout=10_000)
    page.screenshot(path=str(shots / "2-reply-and-live-view.png"))
    page.reload()
    page.wait_for_selector(".msg.assistant .body", timeout=10_000)
    assert page.inner_text(".msg.assistant .body") == reply
    assert page.inner_text(".msg.user") == "What is the capital of France?"


def test_stop_ends_the_reply(page, server, shots) -> None:
    page.click("#settings-open")
    page.fill('[data-testid="max-tokens"]', "400")
    page.click('[data-testid="settings-save"]')
    _send(page, "Write a long story about a ferry crossing a river.")
    page.wait_for_function("(document.querySelector('.msg.assistant .body') || {}).textContent?.length > 0",
                           timeout=60_000)
    page.click("#stop")
    _wait_reply_done(page, 10_000)
    assert "stopped" in page.inner_text('[data-testid="msg-meta"]')
    text = page.inner_text(".msg.assistant .body")
    deadline = time.monotonic() + 10
    while _health(server)["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _health(server)["in_flight"] == 0, "the server still runs the stopped request"
    page.screenshot(path=str(shots / "3-stopped.png"))
    assert page.inner_text(".msg.assistant .body") == text


def _max_tokens(pg, value: str) -> None:
    pg.click("#settings-open")
    pg.fill('[data-testid="max-tokens"]', value)
    pg.click('[data-testid="settings-save"]')


def _sent_messages(pg) -> list[list[dict]]:
    """The ``messages`` of every chat request the page sends from now on (filled as they go)."""
    sent: list[list[dict]] = []
    pg.on("request", lambda r: sent.append(r.post_data_json["messages"])
          if r.method == "POST" and r.url.endswith("/v1/chat/completions") else None)
    return sent


def _stored_last_message(pg) -> dict:
    return pg.evaluate("""() => { const cs = JSON.parse(localStorage.getItem('ferrylm.conversations'));
        const c = cs.find((x) => x.id === localStorage.getItem('ferrylm.current'));
        return c.messages[c.messages.length - 1] || null; }""")


def test_refused_request_names_the_field_and_is_not_sent_again(page, shots) -> None:
    _max_tokens(page, "99999999")
    sent = _sent_messages(page)
    _send(page, "Hello")
    page.wait_for_selector('[data-testid="error-box"]', state="visible", timeout=10_000)
    text = page.inner_text("#error-text")
    assert "(400, context_length_exceeded)" in text and "max_tokens" in text, text
    assert page.locator(".msg.assistant").count() == 0
    assert "not answered" in page.inner_text('.msg.user [data-testid="unanswered"]')
    page.screenshot(path=str(shots / "4-refused-400.png"))
    # the next message goes alone: the refused one stays on the page, marked, not as a second user turn
    _max_tokens(page, "12")
    _send(page, "Hello again")
    _wait_reply_done(page)
    assert page.locator(".msg.assistant .body").inner_text().strip()
    assert sent == [[{"role": "user", "content": "Hello"}], [{"role": "user", "content": "Hello again"}]], sent
    assert page.locator('[data-testid="unanswered"]').count() == 1
    page.reload()
    page.wait_for_selector('.msg.user [data-testid="unanswered"]', timeout=10_000)
    assert page.locator('[data-testid="error-box"]').is_hidden()   # the conversation ends with a reply


def test_a_reload_during_a_reply_keeps_it_marked_interrupted_with_retry(page, server, shots) -> None:
    _max_tokens(page, "400")
    _send(page, "Write a long story about a ferry crossing a river.")
    page.wait_for_function("(document.querySelector('.msg.assistant .body') || {}).textContent?.length > 0",
                           timeout=60_000)
    # saved while it streams (not only at its end)
    page.wait_for_function("""() => { const cs = JSON.parse(localStorage.getItem('ferrylm.conversations'));
        const m = cs.find((x) => x.id === localStorage.getItem('ferrylm.current')).messages.at(-1);
        return m.role === 'assistant' && m.streaming && m.content.length > 0; }""", timeout=10_000)
    assert page.is_visible("#stop")
    page.reload()
    page.wait_for_selector('.msg.assistant [data-testid="interrupted"]', timeout=10_000)
    assert page.inner_text(".msg.assistant .body").strip() and _stored_last_message(page)["content"]
    assert "interrupted" in page.inner_text("#error-text") and page.is_visible('[data-testid="retry"]')
    page.screenshot(path=str(shots / "8-interrupted.png"))
    deadline = time.monotonic() + 10
    while _health(server)["in_flight"] and time.monotonic() < deadline:   # the cut request ends on the server too
        time.sleep(0.2)
    _max_tokens(page, "12")
    sent = _sent_messages(page)
    page.click('[data-testid="retry"]')
    _wait_reply_done(page)
    assert sent == [[{"role": "user", "content": "Write a long story about a ferry crossing a river."}]], sent
    assert page.locator(".msg.assistant").count() == 1 and page.locator('[data-testid="interrupted"]').count() == 0
    assert page.locator('[data-testid="error-box"]').is_hidden()
    assert not _stored_last_message(page).get("streaming")


def test_a_reload_before_the_first_token_leaves_the_question_unanswered_with_retry(page) -> None:
    page.route("**/v1/chat/completions", lambda route: None)   # never answered: the reply is still to come
    _send(page, "Are you there?")
    page.wait_for_function("() => JSON.parse(localStorage.getItem('ferrylm.conversations'))"
                           ".some((c) => (c.messages.at(-1) || {}).streaming)", timeout=10_000)
    page.unroute("**/v1/chat/completions")
    page.reload()
    page.wait_for_selector('.msg.user [data-testid="unanswered"]', timeout=10_000)
    assert page.locator(".msg.assistant").count() == 0
    assert "not answered" in page.inner_text("#error-text") and page.is_visible('[data-testid="retry"]')
    sent = _sent_messages(page)
    page.click('[data-testid="retry"]')
    _wait_reply_done(page)
    page.wait_for_selector(".msg.assistant .meta:has-text('finish:')", timeout=60_000)
    assert sent == [[{"role": "user", "content": "Are you there?"}]] and \
        page.locator('[data-testid="unanswered"]').count() == 0


def test_engine_restart_shows_restarting_then_ready(page, server, shots) -> None:
    os.kill(_health(server)["engine_pid"], signal.SIGKILL)
    page.wait_for_selector('#engine-state[data-state="restarting"]', timeout=10_000)
    _send(page, "Hello again")
    page.wait_for_selector('[data-testid="error-box"]', state="visible", timeout=10_000)
    assert "503" in page.inner_text("#error-text"), page.inner_text("#error-text")
    page.screenshot(path=str(shots / "5-restarting.png"))
    page.wait_for_selector('#engine-state[data-state="ready"]', timeout=120_000)
    assert page.inner_text('[data-testid="live-state"]') == "ready"
    assert "restarts: 1" in page.inner_text("#live-state")
    page.click('[data-testid="retry"]')
    page.wait_for_function("(document.querySelector('.msg.assistant .body') || {}).textContent?.length > 0",
                           timeout=60_000)
    _wait_reply_done(page)
    assert page.locator('[data-testid="error-box"]').is_hidden()
    page.screenshot(path=str(shots / "6-ready-again.png"))


def _sse(*chunks: dict) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def test_reasoning_tool_calls_and_markdown_render(page, shots) -> None:
    """The page's stream reader and renderer on a reply the built-in model cannot give (reasoning, a tool call),
    served by the browser's request interception instead of the server."""
    delta = lambda d, finish=None: {"choices": [{"index": 0, "delta": d, "finish_reason": finish}]}  # noqa: E731
    body = _sse(delta({"role": "assistant", "content": ""}), delta({"reasoning_content": "The user wants "}),
                delta({"reasoning_content": "a table."}),
                delta({"content": "## Result\n\n- **bold** and `code`\n- <script>alert(1)</script>\n\n"}),
                delta({"content": "```python\nprint('hi')\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"}),
                delta({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                       "function": {"name": "get_weather", "arguments": "{\"city\": "}}]}),
                delta({"tool_calls": [{"index": 0, "function": {"arguments": "\"Paris\"}"}}]}, "tool_calls"),
                {"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 30, "total_tokens": 50,
                                          "prompt_tokens_details": {"cached_tokens": 16}}})
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=body))
    _send(page, "Weather in Paris, as a table")
    page.wait_for_selector('[data-testid="msg-meta"]:has-text("finish: tool_calls")', timeout=10_000)
    msg = page.locator(".msg.assistant")
    assert msg.locator("details.reasoning").get_attribute("open") is None   # folded
    assert "The user wants a table." in msg.locator(".reasoning-body").text_content()
    assert msg.locator(".body h2").inner_text() == "Result"
    assert msg.locator(".body li strong").inner_text() == "bold"
    assert msg.locator(".body li code").inner_text() == "code"
    assert msg.locator("script").count() == 0 and "<script>alert(1)</script>" in msg.locator(".body").inner_text()
    assert msg.locator(".code .code-head span").inner_text() == "python"
    assert msg.locator(".code pre").inner_text() == "print('hi')"
    assert msg.locator(".body td").all_inner_texts() == ["1", "2"]
    call = msg.locator('[data-testid="tool-call"]')
    assert "get_weather" in call.inner_text() and json.loads(call.locator("pre").inner_text()) == {"city": "Paris"}
    assert "20 prompt tokens (16 cached) · 30 completion tokens" in msg.locator('[data-testid="msg-meta"]').inner_text()
    page.screenshot(path=str(shots / "7-reasoning-tools-markdown.png"))


def test_conversations_new_rename_export_delete(page) -> None:
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"},
        body=_sse({"choices": [{"index": 0, "delta": {"content": "Hi!"}, "finish_reason": "stop"}]})))
    _send(page, "First conversation")
    page.wait_for_selector(".msg.assistant .meta:has-text('finish: stop')", timeout=10_000)
    page.click("#conv-new")
    assert page.locator("#conv-list li").count() == 2 and page.locator(".msg").count() == 0
    page.locator("#conv-list li", has_text="First conversation").click()
    page.click("#conv-rename")
    page.fill("#conv-list li.current input", "Renamed")
    page.press("#conv-list li.current input", "Enter")
    page.reload()
    page.wait_for_selector("#conv-list li.current", timeout=10_000)
    assert page.inner_text("#conv-list li.current") == "Renamed"
    with page.expect_download() as dl:
        page.click("#conv-export")
    exported = json.loads(Path(dl.value.path()).read_text())
    assert exported["title"] == "Renamed"
    assert [(m["role"], m["content"]) for m in exported["messages"]] == [("user", "First conversation"),
                                                                         ("assistant", "Hi!")]
    page.once("dialog", lambda d: d.accept())
    page.click("#conv-delete")
    assert page.locator("#conv-list li").all_inner_texts() == ["New chat"]
