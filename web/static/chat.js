// The chat page: one conversation, streamed over the same SSE endpoint any OpenAI client uses.
// Model output is only ever written with textContent: it is text, never markup.
"use strict";

const STORAGE_PREFIX = "sluice.";
const SETTING_IDS = ["system-prompt", "temperature", "top-p", "max-tokens", "api-key"];
const HEALTH_RETRY_MS = 1000;
const HEALTH_AFTER_ANSWER_MS = 200;
const HEALTH_WHILE_STREAMING_MS = 2000; // the status line follows the server (a drain, the load) during an answer

const $ = (id) => document.getElementById(id);
const ui = {
  conversation: $("conversation"),
  empty: $("empty"),
  model: $("model"),
  status: $("status"),
  settings: $("settings"),
  systemPrompt: $("system-prompt"),
  temperature: $("temperature"),
  topP: $("top-p"),
  maxTokens: $("max-tokens"),
  apiKey: $("api-key"),
  composer: $("composer"),
  prompt: $("prompt"),
  send: $("send"),
  stop: $("stop"),
  newChat: $("new-chat"),
  template: $("message-template"),
};

let conversation = []; // {role, content}: what the next request sends after the system prompt
let modelName = null;
let isKeyRejected = false; // the server answered 401: the status line says so until a key works
let controller = null; // the AbortController of the answer being streamed

class APIFailure extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// ---- settings ----------------------------------------------------------------------------------------
function restoreSettings() {
  for (const id of SETTING_IDS) {
    const input = $(id);
    const saved = localStorage.getItem(STORAGE_PREFIX + id);
    if (saved !== null) input.value = saved;
    input.addEventListener("input", () => localStorage.setItem(STORAGE_PREFIX + id, input.value));
  }
  ui.apiKey.addEventListener("change", () => {
    ui.apiKey.classList.remove("needs-attention");
    modelName = null;
    loadModel().catch(() => {});
  });
}

function numberSetting(input, name) {
  if (input.value.trim() === "" && input.placeholder) return undefined; // left to the server
  const value = Number(input.value);
  if (input.value.trim() === "" || !Number.isFinite(value)) throw new APIFailure(0, `${name} must be a number`);
  return value;
}

function authHeaders() {
  const headers = { "Content-Type": "application/json" };
  const key = ui.apiKey.value.trim();
  if (key) headers.Authorization = `Bearer ${key}`;
  return headers;
}

function askForKey() {
  isKeyRejected = true;
  setStatus("needs-key", "API key needed");
  ui.settings.open = true;
  ui.apiKey.classList.add("needs-attention");
  ui.apiKey.focus();
}

// ---- server state ------------------------------------------------------------------------------------
function setStatus(state, text) {
  ui.status.dataset.state = state;
  ui.status.textContent = text;
}

async function refreshHealth() {
  try {
    const response = await fetch("/health", { cache: "no-store" });
    const health = await response.json();
    const busy = `${health.running} running, ${health.waiting} waiting`;
    if (isKeyRejected && health.state === "ready") setStatus("needs-key", "API key needed");
    else setStatus(health.state, health.state === "ready" ? `ready · ${busy}` : health.state);
    if (health.state === "loading") setTimeout(refreshHealth, HEALTH_RETRY_MS);
    else if (health.state === "ready" && modelName === null) loadModel().catch(() => {});
  } catch (error) {
    setStatus("error", "server unreachable");
    setTimeout(refreshHealth, HEALTH_RETRY_MS * 5);
  }
}

async function loadModel() {
  const response = await fetch("/v1/models", { headers: authHeaders(), cache: "no-store" });
  if (response.status === 401) {
    askForKey();
    throw new APIFailure(401, await errorMessage(response));
  }
  if (!response.ok) throw new APIFailure(response.status, await errorMessage(response));
  const body = await response.json();
  modelName = body.data[0].id;
  ui.model.textContent = modelName;
  if (isKeyRejected) {
    isKeyRejected = false;
    refreshHealth();
  }
  return modelName;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || `HTTP ${response.status}`;
  } catch {
    return `HTTP ${response.status}`;
  }
}

// ---- messages ----------------------------------------------------------------------------------------
function addMessage(kind, role, text) {
  ui.empty.hidden = true;
  const article = ui.template.content.firstElementChild.cloneNode(true);
  article.classList.add(kind);
  article.querySelector(".role").textContent = role;
  article.querySelector(".text").textContent = text;
  ui.conversation.append(article);
  scrollToEnd(true);
  return article;
}

function scrollToEnd(force) {
  const c = ui.conversation;
  const nearEnd = c.scrollHeight - c.scrollTop - c.clientHeight < 80;
  if (force || nearEnd) c.scrollTop = c.scrollHeight;
}

function formatFigures(f) {
  const parts = [];
  if (f.ttftMs !== null) parts.push(`TTFT ${Math.round(f.ttftMs)} ms`);
  if (f.tokensPerSecond !== null) parts.push(`${f.tokensPerSecond.toFixed(1)} tok/s`);
  parts.push(`${f.tokens} token${f.tokens === 1 ? "" : "s"}`);
  parts.push(f.finishReason ? `finish: ${f.finishReason}` : "streaming…");
  return parts.join(" · ");
}

// ---- streaming ---------------------------------------------------------------------------------------
// Yields each event's data: parsed JSON, or the string "[DONE]".
async function* sseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let boundary;
      while ((boundary = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const block = buffer.slice(0, boundary);
        buffer = buffer.slice(boundary).replace(/^\r?\n\r?\n/, "");
        const data = block
          .split(/\r?\n/)
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (data) yield data === "[DONE]" ? data : JSON.parse(data);
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

function buildRequest() {
  const messages = [];
  const system = ui.systemPrompt.value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...conversation);
  return {
    model: modelName,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberSetting(ui.temperature, "temperature"),
    top_p: numberSetting(ui.topP, "top p"),
    max_tokens: numberSetting(ui.maxTokens, "max tokens"),
  };
}

async function streamAnswer(article, signal) {
  const textView = article.querySelector(".text");
  const figuresView = article.querySelector(".figures");
  const figures = { ttftMs: null, tokensPerSecond: null, tokens: 0, finishReason: null };
  let text = "";
  let firstTokenAt = null;
  let lastTokenAt = null;
  const showFigures = () => {
    if (figures.tokens > 1 && lastTokenAt > firstTokenAt) {
      figures.tokensPerSecond = ((figures.tokens - 1) * 1000) / (lastTokenAt - firstTokenAt);
    }
    figuresView.textContent = formatFigures(figures);
  };
  const sentAt = performance.now();
  showFigures();
  try {
    if (modelName === null) await loadModel();
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: authHeaders(),
      body: JSON.stringify(buildRequest()),
      signal,
    });
    if (response.status === 401) askForKey();
    if (!response.ok) throw new APIFailure(response.status, await errorMessage(response));
    for await (const event of sseEvents(response.body)) {
      if (event === "[DONE]") break;
      if (event.error) throw new APIFailure(500, event.error.message);
      if (event.usage) figures.tokens = event.usage.completion_tokens;
      const choice = event.choices && event.choices[0];
      if (!choice) {
        showFigures();
        continue;
      }
      const piece = choice.delta && choice.delta.content;
      if (piece) {
        lastTokenAt = performance.now();
        if (firstTokenAt === null) {
          firstTokenAt = lastTokenAt;
          figures.ttftMs = lastTokenAt - sentAt;
        }
        figures.tokens += 1; // a delta per token but for held-back pieces: the usage chunk corrects it
        text += piece;
        textView.textContent = text;
        scrollToEnd(false);
      }
      if (choice.finish_reason) figures.finishReason = choice.finish_reason;
      showFigures();
    }
    if (figures.finishReason === null) figures.finishReason = "incomplete";
  } catch (error) {
    if (error.name === "AbortError") {
      figures.finishReason = "stopped";
    } else {
      figures.finishReason = "error";
      if (!text) article.remove(); // nothing was generated: the error note says why
      const note = addMessage("error", "Error", error.message);
      note.querySelector(".figures").remove();
    }
  }
  showFigures();
  article.dataset.finishReason = figures.finishReason;
  return text;
}

async function send(text) {
  const turns = conversation; // the conversation this answer belongs to (New chat starts another)
  turns.push({ role: "user", content: text });
  addMessage("user", "You", text).querySelector(".figures").remove();
  const article = addMessage("assistant", "Assistant", "");
  article.classList.add("streaming");
  controller = new AbortController();
  setBusy(true);
  const watching = setInterval(refreshHealth, HEALTH_WHILE_STREAMING_MS);
  try {
    const answer = await streamAnswer(article, controller.signal);
    // A failed request leaves nothing; any other answer stays as far as it got, an empty one too, so that the
    // roles keep alternating (Gemma's template refuses two user turns in a row).
    if (article.dataset.finishReason === "error") turns.pop();
    else turns.push({ role: "assistant", content: answer });
  } finally {
    clearInterval(watching);
    article.classList.remove("streaming");
    controller = null;
    setBusy(false);
    setTimeout(refreshHealth, HEALTH_AFTER_ANSWER_MS); // a stopped request is freed just after the abort
  }
}

function setBusy(busy) {
  ui.send.disabled = busy;
  ui.stop.disabled = !busy;
  if (!busy) ui.prompt.focus();
}

function stop() {
  if (controller) controller.abort();
}

function newChat() {
  stop();
  conversation = []; // an answer still ending adds its turns to the old one, not to this
  for (const article of ui.conversation.querySelectorAll(".message")) article.remove();
  ui.empty.hidden = false;
  ui.prompt.focus();
}

// ---- wiring ------------------------------------------------------------------------------------------
ui.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = ui.prompt.value.trim();
  if (!text || controller) return;
  ui.prompt.value = "";
  send(text);
});

ui.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    ui.composer.requestSubmit();
  }
});

document.addEventListener("keydown", (event) => {
  if (event.key === "Escape") stop();
});

ui.stop.addEventListener("click", stop);
ui.newChat.addEventListener("click", newChat);

restoreSettings();
refreshHealth();
ui.prompt.focus();
