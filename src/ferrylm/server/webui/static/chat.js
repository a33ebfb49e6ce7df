// The chat: the current conversation's messages, a streaming reply with a stop button, errors with retry.

import { ApiError, streamChat } from "./api.js";
import { escapeHtml, renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const TEMPORARY = new Set(["engine_unavailable", "insufficient_memory", "queue_timeout", "engine_stalled",
                           "server_overloaded"]);
const SAVE_MS = 500;   // a streaming reply is saved this often, so a reload finds it (marked interrupted)

/** What to tell a person about `e` (an ApiError): one line of HTML, and whether a retry may help. */
export function describeError(e) {
  const param = e.param ? ` <span class="param">${escapeHtml(e.param)}</span>` : "";
  const msg = escapeHtml(e.message);
  const code = e.code ? `, ${escapeHtml(e.code)}` : "";
  if (e.status === 0) return `<b>Cannot reach the server.</b> ${msg}`;
  if (e.status === 401) return `<b>The server refused the API key (401).</b> Enter the key and retry.`;
  if (e.status === 503 || TEMPORARY.has(e.code)) {
    const after = e.retryAfter ? ` The server suggests retrying in ${e.retryAfter} s.` : "";
    return `<b>The engine cannot take the request now (${e.status || "stream"}${code}).</b> ${msg}.${after} ` +
           "Retry once the engine state reads ready.";
  }
  if (e.status === null) return `<b>The reply was cut by an error${code}.</b> ${msg}`;
  if (e.status >= 400 && e.status < 500) return `<b>The server refused the request (${e.status}${code}).</b>${param} ${msg}`;
  return `<b>Server error (${e.status}${code}).</b> ${msg}`;
}

function toolCallsHtml(calls) {
  return (calls || []).map((c) => {
    let args = c.arguments || "";
    try { args = JSON.stringify(JSON.parse(args), null, 2); } catch { /* partial or not JSON: as it came */ }
    return `<div class="tool-call" data-testid="tool-call"><span class="tool-label">tool call</span> ` +
           `<b>${escapeHtml(c.name || "?")}</b><pre>${escapeHtml(args)}</pre></div>`;
  }).join("");
}

function metaHtml(m) {
  const parts = [];
  const u = m.usage;
  if (u) {
    parts.push(`${u.prompt_tokens} prompt tokens (${u.cached_tokens || 0} cached)`);
    parts.push(`${u.completion_tokens} completion tokens`);
  }
  const s = m.stats || {};
  if (s.ttft_s != null) parts.push(`first token ${s.ttft_s.toFixed(2)} s`);
  if (s.tok_s) parts.push(`${s.tok_s.toFixed(1)} tok/s`);
  if (s.finish_reason) parts.push(`finish: ${escapeHtml(s.finish_reason)}`);
  if (m.stopped) parts.push('<span class="stopped">stopped</span>');
  if (m.interrupted) parts.push('<span class="stopped" data-testid="interrupted">interrupted</span>');
  if (m.error) parts.push(`<span class="stopped">error: ${escapeHtml(m.error)}</span>`);
  return parts.join(" · ");
}

function messageHtml(m, streaming) {
  if (m.role === "user") {
    if (!m.unanswered) return escapeHtml(m.content);
    return `${escapeHtml(m.content)}<div class="meta" data-testid="unanswered"><span class="stopped">not ` +
           `answered</span> · ${escapeHtml(m.unanswered)} (not sent again unless you retry)</div>`;
  }
  let html = "";
  if (m.reasoning) {
    html += `<details class="reasoning" data-testid="reasoning"><summary>Reasoning ` +
            `(${m.reasoning.length} characters)</summary><div class="reasoning-body">` +
            `${escapeHtml(m.reasoning)}</div></details>`;
  }
  html += `<div class="body${streaming ? " cursor" : ""}" data-testid="reply">${renderMarkdown(m.content)}</div>`;
  html += toolCallsHtml(m.tool_calls);
  html += `<div class="meta" data-testid="msg-meta">${metaHtml(m)}</div>`;
  return html;
}

export class Chat {
  /** `store`: conversations; `settings()`: sampling settings; `model()`: the served model's name (or "");
   * `onUnauthorized()`: called on a 401. */
  constructor(store, settings, model, onUnauthorized) {
    Object.assign(this, { store, settings, model, onUnauthorized });
    this.abort = null;
    this.pending = null;
    $("messages").addEventListener("click", (ev) => {
      const b = ev.target.closest(".copy-code");
      if (b && navigator.clipboard) navigator.clipboard.writeText(b.closest(".code").querySelector("pre").innerText);
    });
  }

  get streaming() { return this.abort !== null; }

  render() {
    const box = $("messages");
    const c = this.store.current;
    box.innerHTML = "";
    if (!c.messages.length) box.innerHTML = '<div class="empty">Send a message to start.</div>';
    c.messages.forEach((m, i) => box.appendChild(this.element(m, this.streaming && i === c.messages.length - 1)));
    box.scrollTop = box.scrollHeight;
  }

  element(m, streaming) {
    const el = document.createElement("div");
    el.className = `msg ${m.role}`;
    el.dataset.testid = `msg-${m.role}`;
    el.innerHTML = messageHtml(m, streaming);
    return el;
  }

  async send(text) {
    if (this.streaming || !text.trim()) return;
    const c = this.store.current;
    c.messages.push({ role: "user", content: text });
    this.store.autoTitle(c);
    this.store.save();
    await this.generate();
  }

  stop() { if (this.abort) this.abort.abort(); }

  /** Send the conversation again after an error or an interrupted reply: a failed or cut reply is dropped, an
   * unanswered last message is sent again. */
  async retry() {
    const c = this.store.current;
    const last = c.messages[c.messages.length - 1];
    if (last && last.role === "assistant" && (last.error || last.interrupted || !last.content)) c.messages.pop();
    const user = c.messages[c.messages.length - 1];
    if (!user || user.role !== "user") return;
    delete user.unanswered;
    await this.generate();
  }

  /** The error box for the conversation just shown: Retry when its last turn was left without a whole reply
   * (a reply cut by closing or reloading the page, a message the server did not answer). */
  showLeftover() {
    const c = this.store.current;
    const last = c.messages[c.messages.length - 1];
    $("error-box").hidden = true;
    if (!last || this.streaming) return;
    if (last.interrupted) {
      this.showNotice("<b>The reply was interrupted</b> (the page was closed or reloaded while it came). " +
                      "Retry asks for it again.");
    } else if (last.role === "user" && last.unanswered) {
      this.showNotice(`<b>This message was not answered:</b> ${escapeHtml(last.unanswered)}. Retry sends it again.`);
    }
  }

  request(c) {
    const s = this.settings();
    const messages = s.system ? [{ role: "system", content: s.system }] : [];
    // earlier tool calls stay on the page only: the page runs no tools, so it has no results to send back; a
    // message the server did not answer stays on the page only too (it would be a second user turn in a row)
    for (const m of c.messages) if (!m.unanswered) messages.push({ role: m.role, content: m.content || "" });
    const body = { messages, stream_options: { include_usage: true } };
    if (this.model()) body.model = this.model();
    for (const k of ["temperature", "top_p", "max_tokens"]) {   // an empty field: the server's default
      if (s[k] !== "" && s[k] != null) body[k] = Number(s[k]);
    }
    if (s.tools && s.tools.trim()) body.tools = JSON.parse(s.tools);
    return body;
  }

  async generate() {
    const c = this.store.current;
    const body = this.request(c);
    // `streaming` is saved with it: a page loaded while it is set finds the reply cut (store.js settles it)
    const m = { role: "assistant", content: "", reasoning: "", tool_calls: [], streaming: true };
    c.messages.push(m);
    this.store.save();
    let saved = performance.now();
    this.abort = new AbortController();
    this.setBusy(true);
    this.render();
    const el = $("messages").lastElementChild;
    const t0 = performance.now();
    let tFirst = null, tLast = null;
    const paint = () => {
      this.pending = null;
      el.innerHTML = messageHtml(m, true);
      $("messages").scrollTop = $("messages").scrollHeight;
    };
    try {
      await streamChat(body, this.abort.signal, (chunk) => {
        for (const ch of chunk.choices || []) {
          const d = ch.delta || {};
          if (d.content || d.reasoning_content || d.tool_calls) tLast = performance.now();
          if (tFirst === null && tLast !== null) tFirst = tLast;
          if (d.reasoning_content) m.reasoning += d.reasoning_content;
          if (d.content) m.content += d.content;
          for (const tc of d.tool_calls || []) {
            const slot = (m.tool_calls[tc.index || 0] ||= { id: "", name: "", arguments: "" });
            if (tc.id) slot.id = tc.id;
            if (tc.function && tc.function.name) slot.name = tc.function.name;
            if (tc.function && tc.function.arguments) slot.arguments += tc.function.arguments;
          }
          if (ch.finish_reason) (m.stats ||= {}).finish_reason = ch.finish_reason;
        }
        if (chunk.usage) {
          const u = chunk.usage;
          m.usage = { prompt_tokens: u.prompt_tokens, completion_tokens: u.completion_tokens,
                      cached_tokens: (u.prompt_tokens_details || {}).cached_tokens || 0 };
        }
        if (this.pending === null) this.pending = requestAnimationFrame(paint);
        if (performance.now() - saved >= SAVE_MS) { this.store.save(); saved = performance.now(); }
      });
    } catch (e) {
      if (e.name === "AbortError") m.stopped = true;
      else this.fail(c, m, e);
    } finally {
      if (this.pending !== null) cancelAnimationFrame(this.pending);
      this.pending = null;
      this.abort = null;
      delete m.streaming;
      this.setBusy(false);
    }
    const stats = (m.stats ||= {});
    if (tFirst !== null) stats.ttft_s = (tFirst - t0) / 1000;
    const n = m.usage ? m.usage.completion_tokens : 0;
    if (n > 1 && tLast > tFirst) stats.tok_s = (n - 1) / ((tLast - tFirst) / 1000);
    if (!m.reasoning) delete m.reasoning;
    if (!m.tool_calls.length) delete m.tool_calls;
    this.store.save();
    this.render();
  }

  fail(c, m, e) {
    if (!(e instanceof ApiError)) e = new ApiError(null, String(e && e.message ? e.message : e));
    if (!m.content && !(m.tool_calls || []).length) {   // nothing came: no reply to keep, the question unanswered
      c.messages.pop();
      const user = c.messages[c.messages.length - 1];
      if (user && user.role === "user") user.unanswered = e.message;
    } else {
      m.error = e.message;
    }
    this.showError(e);
    if (e.unauthorized) this.onUnauthorized();
  }

  showError(e) { this.showNotice(describeError(e)); }

  showNotice(html) {
    $("error-text").innerHTML = html;
    $("error-box").hidden = false;
  }

  setBusy(busy) {
    $("stop").hidden = !busy;
    $("send").disabled = busy;
    if (busy) $("error-box").hidden = true;
  }
}
