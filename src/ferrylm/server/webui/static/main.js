// The page's start: model info, the API key dialog, settings, conversations, and the live view's poll.

import { ApiError, apiKey, getJson, setApiKey } from "./api.js";
import { Chat } from "./chat.js";
import { LiveView } from "./live.js";
import { Store, loadSettings, saveSettings } from "./store.js";

const $ = (id) => document.getElementById(id);
const POLL_MS = 1000;

const store = new Store();
let settings = loadSettings();
let modelName = "";
const live = new LiveView();
const chat = new Chat(store, () => settings, () => modelName, askForKey);

// ---- API key ------------------------------------------------------------------------------------------------
function askForKey(why) {
  const d = $("key-dialog");
  if (why !== undefined || !d.open) $("key-error").textContent = why || "";
  if (!d.open) d.showModal();
}

$("key-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  if (ev.submitter && ev.submitter.value === "cancel") { $("key-dialog").close(); return; }
  setApiKey(ev.target.elements.key.value.trim());
  if (await loadModel()) {
    $("key-dialog").close();
    ev.target.elements.key.value = "";
  }
});
$("key-open").addEventListener("click", () => askForKey(apiKey() ? "A key is set; enter another to replace it." : ""));

// ---- model --------------------------------------------------------------------------------------------------
/** Read the served model; true when the server answered (false after a 401, which asks for the key). */
async function loadModel() {
  try {
    const models = await getJson("v1/models");
    const m = models.data[0];
    modelName = m.id;
    $("model-name").textContent = m.id;
    $("model-ctx").textContent = m.max_model_len ? `context ${m.max_model_len.toLocaleString("en")} tokens` : "";
    return true;
  } catch (e) {
    if (e instanceof ApiError && e.unauthorized) askForKey(apiKey() ? "The server refused this key." : "");
    else $("model-name").textContent = e.message;
    return false;
  }
}

// ---- settings -----------------------------------------------------------------------------------------------
$("settings-open").addEventListener("click", () => {
  const f = $("settings-form").elements;
  for (const k of ["system", "temperature", "top_p", "max_tokens", "tools"]) f[k].value = settings[k] ?? "";
  $("settings-error").textContent = "";
  $("settings").showModal();
});
$("settings-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  if (ev.submitter && ev.submitter.value === "cancel") { $("settings").close(); return; }
  const f = ev.target.elements;
  const next = { system: f.system.value, temperature: f.temperature.value, top_p: f.top_p.value,
                 max_tokens: f.max_tokens.value, tools: f.tools.value };
  if (next.tools.trim()) {
    try {
      if (!Array.isArray(JSON.parse(next.tools))) throw new Error("not a list");
    } catch (e) {
      $("settings-error").textContent = `Tools must be a JSON list of tools (${e.message}).`;
      return;
    }
  }
  settings = next;
  saveSettings(settings);
  $("settings").close();
});

// ---- conversations ------------------------------------------------------------------------------------------
function renderList() {
  const ul = $("conv-list");
  ul.innerHTML = "";
  for (const c of store.conversations) {
    const li = document.createElement("li");
    li.textContent = c.title;
    li.title = c.title;
    li.dataset.id = c.id;
    if (c.id === store.currentId) li.className = "current";
    li.addEventListener("click", () => { if (c.id !== store.currentId) { chat.stop(); store.select(c.id); show(); } });
    ul.appendChild(li);
  }
}

function show() {
  renderList();
  chat.render();
  chat.showLeftover();
}

$("conv-new").addEventListener("click", () => { chat.stop(); store.create(); show(); });
$("conv-delete").addEventListener("click", () => {
  const c = store.current;
  if (c.messages.length && !confirm(`Delete "${c.title}"?`)) return;
  chat.stop();
  store.remove(c.id);
  show();
});
$("conv-rename").addEventListener("click", () => {
  const li = $("conv-list").querySelector("li.current");
  const input = document.createElement("input");
  input.value = store.current.title;
  li.textContent = "";
  li.appendChild(input);
  input.focus();
  input.select();
  const done = (keep) => { if (keep) store.rename(store.currentId, input.value); renderList(); };
  input.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter") done(true);
    if (ev.key === "Escape") done(false);
  });
  input.addEventListener("blur", () => done(true));
});
$("conv-export").addEventListener("click", () => {
  const c = store.current;
  const blob = new Blob([store.exportJson(c, settings)], { type: "application/json" });
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = `${c.title.replace(/[^\w.-]+/g, "_").slice(0, 60) || "conversation"}.json`;
  a.click();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
});

// ---- composer -----------------------------------------------------------------------------------------------
$("composer").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || chat.streaming) return;
  $("prompt").value = "";
  const sending = chat.send(text);
  renderList();
  await sending;
  renderList();
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => chat.stop());
$("retry").addEventListener("click", () => chat.retry());

// ---- live view ----------------------------------------------------------------------------------------------
function setState(status) {
  const el = $("engine-state");
  el.dataset.state = status;
  el.textContent = status;
}

async function poll() {
  try {
    const snap = await getJson(`v1/live${live.query}`);
    live.update(snap);
    setState(snap.state.status);
    if (!modelName) await loadModel();
  } catch (e) {
    if (e instanceof ApiError && e.unauthorized) { setState("locked"); askForKey(); }
    else setState(e instanceof ApiError && e.status === 0 ? "unreachable" : "error");
  }
  setTimeout(poll, POLL_MS);
}

show();
loadModel();
poll();
