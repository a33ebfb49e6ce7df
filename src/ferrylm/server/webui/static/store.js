// Conversations and sampling settings, kept in the browser's localStorage (nothing is stored on the server).
//
// A conversation: {id, title, titled (renamed by hand), created (ms), messages}. A message: {role: "user" |
// "assistant", content, reasoning?, tool_calls?: [{id, name, arguments}], usage?: {prompt_tokens,
// completion_tokens, cached_tokens}, stats?: {ttft_s, tok_s, finish_reason}, stopped?, error?, streaming? (saved
// while it comes), interrupted? (it was streaming when the page went away)}; a user message the server did not
// answer has unanswered: why (it stays on the page, and is not sent again unless retried).

const CONVERSATIONS = "ferrylm.conversations";
const CURRENT = "ferrylm.current";
const SETTINGS = "ferrylm.settings";

export const DEFAULT_SETTINGS = { system: "", temperature: 0.7, top_p: 1, max_tokens: 1024, tools: "" };

function readJson(key, fallback) {
  try {
    const v = JSON.parse(localStorage.getItem(key));
    return v === null ? fallback : v;
  } catch {
    return fallback;
  }
}

/** A reply that was still streaming when the page went away (closed, reloaded): what came is kept, marked
 * interrupted; when nothing came, the reply goes and its question is marked unanswered. */
function settle(c) {
  const last = c.messages[c.messages.length - 1];
  if (!last || !last.streaming) return;
  delete last.streaming;
  if (!last.reasoning) delete last.reasoning;
  if (!(last.tool_calls || []).length) delete last.tool_calls;
  if (last.content || last.reasoning || last.tool_calls) {
    last.interrupted = true;
    return;
  }
  c.messages.pop();
  const user = c.messages[c.messages.length - 1];
  if (user && user.role === "user") user.unanswered = "the page was closed or reloaded before the reply came";
}

function newId() { return `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 8)}`; }

export class Store {
  constructor() {
    this.conversations = readJson(CONVERSATIONS, []);
    if (!Array.isArray(this.conversations)) this.conversations = [];
    this.conversations.forEach(settle);
    this.currentId = localStorage.getItem(CURRENT);
    if (!this.current) this.currentId = this.conversations.length ? this.conversations[0].id : this.create().id;
  }

  get current() { return this.conversations.find((c) => c.id === this.currentId) || null; }

  save() {
    localStorage.setItem(CONVERSATIONS, JSON.stringify(this.conversations));
    localStorage.setItem(CURRENT, this.currentId);
  }

  create() {
    const c = { id: newId(), title: "New chat", titled: false, created: Date.now(), messages: [] };
    this.conversations.unshift(c);
    this.currentId = c.id;
    this.save();
    return c;
  }

  select(id) { this.currentId = id; this.save(); }

  rename(id, title) {
    const c = this.conversations.find((x) => x.id === id);
    if (!c || !title.trim()) return;
    c.title = title.trim();
    c.titled = true;
    this.save();
  }

  remove(id) {
    this.conversations = this.conversations.filter((c) => c.id !== id);
    if (this.currentId === id) this.currentId = this.conversations.length ? this.conversations[0].id : null;
    if (!this.currentId) this.create(); else this.save();
  }

  /** Name an untitled conversation after its first user message. */
  autoTitle(c) {
    if (c.titled) return;
    const first = c.messages.find((m) => m.role === "user");
    if (first) c.title = first.content.replace(/\s+/g, " ").trim().slice(0, 48) || "New chat";
  }

  exportJson(c, settings) {
    return JSON.stringify({ format: "ferrylm.conversation", version: 1, exported: new Date().toISOString(),
                            settings, ...c }, null, 2);
  }
}

export function loadSettings() { return { ...DEFAULT_SETTINGS, ...readJson(SETTINGS, {}) }; }
export function saveSettings(s) { localStorage.setItem(SETTINGS, JSON.stringify(s)); }
