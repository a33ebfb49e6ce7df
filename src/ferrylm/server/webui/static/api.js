// The server's HTTP API as the page uses it: the API key (kept in localStorage), JSON calls, the chat stream
// (SSE), and errors in the OpenAI shape turned into ApiError.

const KEY_STORE = "ferrylm.apiKey";

export function apiKey() { return localStorage.getItem(KEY_STORE) || ""; }
export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORE, key); else localStorage.removeItem(KEY_STORE);
}

/** An HTTP error: `status` (0: the server could not be reached; null: an error event inside a stream), the OpenAI error's message / param / code, and
 * the Retry-After seconds of a 503. */
export class ApiError extends Error {
  constructor(status, message, { param = null, code = null, retryAfter = null } = {}) {
    super(message);
    this.status = status;
    this.param = param;
    this.code = code;
    this.retryAfter = retryAfter;
  }
  get unauthorized() { return this.status === 401; }
}

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = apiKey();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function errorOf(resp) {
  let body = null;
  try { body = await resp.json(); } catch { /* not JSON */ }
  const err = (body && body.error) || {};
  const retry = resp.headers.get("retry-after");
  return new ApiError(resp.status, err.message || `${resp.status} ${resp.statusText}`,
                      { param: err.param, code: err.code, retryAfter: retry ? Number(retry) : null });
}

async function call(path, init) {
  let resp;
  try {
    resp = await fetch(path, init);
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError(0, "the server cannot be reached");
  }
  if (!resp.ok) throw await errorOf(resp);
  return resp;
}

/** GET `path` (relative to the page) as JSON. Throws ApiError. */
export async function getJson(path) {
  return (await call(path, { headers: headers(false), cache: "no-store" })).json();
}

/** POST a streaming chat completion; `onChunk(chunk)` gets each decoded event. Resolves when the stream ends
 * (`[DONE]`); throws ApiError for an HTTP error or an error event, AbortError when `signal` aborts. */
export async function streamChat(body, signal, onChunk) {
  const resp = await call("v1/chat/completions", {
    method: "POST", headers: headers(true), body: JSON.stringify({ ...body, stream: true }), signal,
  });
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;   // ": ping" keep-alives and other fields
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) {
          const e = chunk.error;
          throw new ApiError(null, e.message || "error", { param: e.param, code: e.code });
        }
        onChunk(chunk);
      }
    }
  }
  throw new ApiError(0, "the stream ended before [DONE] (the connection was lost)");
}
