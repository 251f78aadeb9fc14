// mlxfleet dashboard: plain ES module, no build step, no external resources.
// Every byte of data comes from the public and control APIs, with the tab's API key.

const KEY = "mlxfleet.apiKey";
const $ = (sel, root = document) => root.querySelector(sel);
const el = (tag, attrs = {}, ...kids) => {
  const n = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v == null || v === false) continue;
    if (k === "class") n.className = v;
    else if (k.startsWith("on")) n.addEventListener(k.slice(2), v);
    else n.setAttribute(k, v);
  }
  for (const k of kids) n.append(k instanceof Node ? k : document.createTextNode(k ?? ""));
  return n;
};

// ---- API access -------------------------------------------------------------

class Unauthorized extends Error {}

function headers(extra = {}) {
  const key = sessionStorage.getItem(KEY);
  return key ? { Authorization: `Bearer ${key}`, ...extra } : extra;
}

async function api(path, opts = {}) {
  const r = await fetch(path, { ...opts, headers: headers(opts.headers) });
  if (r.status === 401) { askKey(); throw new Unauthorized(); }
  const type = r.headers.get("content-type") || "";
  const body = type.includes("json") ? await r.json() : await r.text();
  if (!r.ok) {
    const err = new Error(errorText(body) || `HTTP ${r.status}`);
    err.body = body;
    throw err;
  }
  return body;
}

function errorText(body) {
  if (!body || typeof body !== "object") return body;
  const e = body.error;
  return typeof e === "string" ? e : e?.message;
}

let keyAsked = false;
function askKey(message) {
  keyAsked = true;
  const d = $("#key-dialog");
  $("#key-error").hidden = !message;
  $("#key-error").textContent = message || "";
  if (!d.open) d.showModal();
}

$("#key-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(KEY, $("#key-input").value.trim());
  const r = await fetch("/mlxfleet/v1/models", { headers: headers() });
  if (r.status === 401) { askKey("That key was refused."); return; }
  keyAsked = false;
  $("#key-dialog").close();
  refresh();
});

// ---- formatting ---------------------------------------------------------------

const gib = (b) => b == null ? "-" : b >= 1 << 30 ? `${(b / 2 ** 30).toFixed(2)} GiB`
  : `${(b / 2 ** 20).toFixed(0)} MiB`;
const secs = (s) => s == null ? "-" : s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(2)} s`;

function countdown(m) {
  if (m.keepAlive === "forever") return "forever";
  if (!m.loaded) return "-";
  if (m.inflight) return "busy";
  if (!m.expiresAt) return `${Math.round(m.keepAlive / 60)}m after use`;
  const left = Math.max(0, (Date.parse(m.expiresAt) - Date.now()) / 1000);
  const mm = Math.floor(left / 60), ss = Math.floor(left % 60);
  return `${mm}:${String(ss).padStart(2, "0")}`;
}

// ---- state and polling ------------------------------------------------------------

const state = { models: null, status: null, history: [], lastTokens: null, seenTtft: new Set() };
const HISTORY = 300; // samples (one a second): five minutes

async function poll() {
  if (keyAsked) return;
  try {
    const [models, status, nodes] = await Promise.all([
      api("/mlxfleet/v1/models"), api("/v1/status"), api("/mlxfleet/v1/nodes")]);
    state.models = models;
    state.status = status;
    state.nodes = nodes;
    $("#nav-nodes").hidden = !nodes.items.length; // a fleet's node (serve --node) only
    sample(models, status);
    $("#conn").textContent = "";
    render();
  } catch (e) {
    if (!(e instanceof Unauthorized)) $("#conn").textContent = `offline: ${e.message}`;
  }
}

function sample(models, status) {
  const now = Date.now();
  const tokens = status.total_completion_tokens || 0;
  let tps = 0;
  if (state.lastTokens) {
    const dt = (now - state.lastTokens.t) / 1000;
    tps = dt > 0 ? Math.max(0, tokens - state.lastTokens.n) / dt : 0;
  }
  state.lastTokens = { t: now, n: tokens };
  const ttfts = [];
  for (const r of status.requests || []) {
    if (r.ttft_s != null && !state.seenTtft.has(r.request_id)) {
      state.seenTtft.add(r.request_id);
      ttfts.push(r.ttft_s);
    }
  }
  const mem = (models.memory?.usedBytes || 0) / 2 ** 30;
  state.history.push({ t: now, tps, ttft: ttfts.length ? Math.max(...ttfts) : null, mem });
  if (state.history.length > HISTORY) state.history.shift();
  if (state.seenTtft.size > 5000) state.seenTtft.clear();
}

function modelTps(name) {
  return (state.status?.requests || []).filter((r) => r.model === name)
    .reduce((a, r) => a + (r.tokens_per_second || 0), 0);
}

// ---- pages -------------------------------------------------------------------------

function route() {
  const [page, arg] = (location.hash.slice(1) || "models").split("/");
  return { page, arg: arg && decodeURIComponent(arg) };
}

function render() {
  const { page, arg } = route();
  for (const s of document.querySelectorAll(".page")) s.hidden = true;
  for (const a of document.querySelectorAll("nav a")) {
    a.classList.toggle("active", a.dataset.page === (page === "model" ? "models" : page));
  }
  const section = $(`#page-${page}`) || $("#page-models");
  section.hidden = false;
  if (!state.models) return;
  if (page === "models" || !$(`#page-${page}`)) renderModels();
  else if (page === "model") renderDetail(arg);
  else if (page === "nodes") renderNodes();
  else if (page === "requests") renderRequests();
  else if (page === "metrics") renderMetrics();
  else if (page === "chat") renderChatModels();
}

function renderModels() {
  const { items, manifestErrors, memory } = state.models;
  $("#memory").textContent = memory
    ? `memory ${gib(memory.usedBytes)} of ${gib(memory.budgetBytes)} (${memory.budgetSource})` : "";
  const errs = Object.entries(manifestErrors || {});
  $("#manifest-errors").hidden = !errs.length;
  $("#manifest-errors").textContent = errs.map(([f, e]) => `${f}: ${e.join("; ")}`).join("\n");
  renderDownloads(state.models.pulls || []);
  const body = $("#models-table tbody");
  body.replaceChildren(...items.map((m) => el("tr", { "data-model": m.name },
    el("td", {}, el("a", { href: `#model/${encodeURIComponent(m.name)}` }, m.name)),
    el("td", {}, m.aliases.join(", ")),
    el("td", { class: "src", title: m.source }, m.source),
    el("td", { class: `phase ${m.phase}` }, m.pull ? `Pulling ${percent(m.pull)}` : m.phase),
    el("td", { title: m.replicas && m.replicas.reason || "" }, m.replicas
      ? `${m.replicas.items.map((r) => `${r.node}: ${r.phase}`).join(", ")} (${m.replicas.ready}/${m.replicas.desired})`
      : m.node || "local"),
    el("td", {}, m.loaded ? gib(m.memoryBytes) : "-"),
    el("td", {}, countdown(m)),
    el("td", {}, String(m.inflight + (m.waiting || 0))),
    el("td", {}, m.inflight ? modelTps(m.name).toFixed(1) : "-"),
    el("td", {},
      el("button", { onclick: () => act(m.name, "load"), disabled: m.ready ? "" : null }, "Load"),
      el("button", { onclick: () => act(m.name, "unload") }, "Unload"),
      el("button", { class: "danger", onclick: () => remove(m.name) }, "Delete")),
  )));
}

const percent = (p) => p.totalBytes ? `${Math.floor(100 * p.completedBytes / p.totalBytes)}%` : "";

function renderDownloads(pulls) {
  // pulls under way on this machine: /api/pull, `mlxfleet pull`, manifests being applied
  $("#downloads").hidden = !pulls.length;
  $("#downloads-table tbody").replaceChildren(...pulls.map((p) => el("tr", { "data-source": p.source },
    el("td", { class: "src" }, p.source),
    el("td", {}, el("progress", { max: p.totalBytes || 1, value: p.completedBytes })),
    el("td", {}, `${percent(p)} ${gib(p.completedBytes)} of ${gib(p.totalBytes)}`),
    el("td", {}, `${gib(p.bytesPerSecond)}/s`),
    el("td", { class: "muted" }, p.status))));
}

async function act(name, what) {
  $("#conn").textContent = `${what}ing ${name}...`;
  try { await api(`/mlxfleet/v1/models/${encodeURIComponent(name)}/${what}`, { method: "POST" }); }
  catch (e) { if (!(e instanceof Unauthorized)) alert(`${what} ${name}: ${e.message}`); }
  $("#conn").textContent = "";
  poll();
}

async function remove(name) {
  if (!confirm(`Delete model ${name}? Its manifest is removed from the folder.`)) return;
  try { await api(`/mlxfleet/v1/models/${encodeURIComponent(name)}`, { method: "DELETE" }); }
  catch (e) { if (!(e instanceof Unauthorized)) alert(`delete ${name}: ${e.message}`); }
  poll();
}

const TEMPLATE = `apiVersion: mlxfleet/v1
kind: Model
metadata:
  name: my-model
spec:
  source: mlx-community/Qwen3-0.6B-4bit
  keepAlive: 10m
`;

$("#apply-open").addEventListener("click", () => {
  $("#apply-panel").hidden = false;
  if (!$("#apply-text").value) $("#apply-text").value = TEMPLATE;
  $("#apply-text").focus();
});
$("#apply-cancel").addEventListener("click", () => { $("#apply-panel").hidden = true; });
$("#apply-submit").addEventListener("click", async () => {
  const out = $("#apply-errors");
  out.hidden = true;
  $("#apply-result").textContent = "applying...";
  try {
    const r = await api("/mlxfleet/v1/manifests?filename=dashboard.yaml", {
      method: "POST", body: $("#apply-text").value, headers: { "Content-Type": "application/yaml" },
    });
    $("#apply-result").textContent = "applied: " + r.applied
      .map((a) => `${a.name} (${a.action || "applied"})`).join(", ");
    poll();
  } catch (e) {
    if (e instanceof Unauthorized) return;
    $("#apply-result").textContent = "";
    const details = e.body?.error?.details || [];
    out.textContent = [e.message, ...details].join("\n");
    out.hidden = false;
  }
});

// Model detail: conditions, events and the log, followed while the page is open.
let follow = null;
function renderDetail(name) {
  const m = state.models.items.find((x) => x.name === name);
  $("#detail-name").textContent = name;
  if (!m) { $("#detail-phase").textContent = "not found"; return; }
  $("#detail-phase").textContent = m.phase;
  $("#detail-phase").className = `phase ${m.phase}`;
  $("#detail-conditions tbody").replaceChildren(...m.conditions.map((c) => el("tr", {},
    el("td", {}, c.type), el("td", { class: `phase ${c.status}` }, c.status),
    el("td", {}, c.reason || ""), el("td", {}, c.message || ""))));
  $("#detail-events tbody").replaceChildren(...m.events.slice(-20).reverse().map((e) => el("tr", {},
    el("td", {}, (e.time || "").replace("T", " ").slice(0, 19)), el("td", {}, e.type || ""),
    el("td", {}, e.reason || ""), el("td", {}, e.message || ""))));
  if (!follow || follow.name !== name) followLog(name);
}

function followLog(name) {
  if (follow) follow.abort.abort();
  const abort = new AbortController();
  follow = { name, abort };
  const pre = $("#detail-log");
  pre.textContent = "";
  (async () => {
    try {
      const r = await fetch(`/mlxfleet/v1/models/${encodeURIComponent(name)}/logs?tail=200&follow=1`,
        { headers: headers(), signal: abort.signal });
      const reader = r.body.getReader();
      const dec = new TextDecoder();
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        const stick = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 20;
        pre.textContent += dec.decode(value, { stream: true });
        if (pre.textContent.length > 400000) pre.textContent = pre.textContent.slice(-200000);
        if (stick) pre.scrollTop = pre.scrollHeight;
      }
    } catch (e) { /* page left, or the server went away */ }
  })();
}

function renderNodes() {
  const { items, node } = state.nodes;
  $("#nodes-self").textContent = node ? `answering: ${node}` : "not a fleet (serve --node)";
  $("#nodes-table tbody").replaceChildren(...items.map((n) => el("tr", { "data-node": n.name },
    el("td", {}, n.self ? `${n.name} (this)` : n.name),
    el("td", { class: "src" }, n.url),
    el("td", { class: `phase ${n.status}`, title: n.error || "" }, n.status),
    el("td", {}, n.models.join(", ") || "-"),
    el("td", {}, `${gib(n.memory.usedBytes)} / ${gib(n.memory.capacityBytes)}`),
    el("td", {}, Object.entries(n.labels).map(([k, v]) => `${k}=${v}`).join(", ") || "-"),
    el("td", { title: (n.accelerator && n.accelerator.memorySource) || "" },
      n.accelerator && n.accelerator.kind !== "cpu"
        ? `${n.chip || "-"} (${n.accelerator.kind}: ${n.accelerator.name})` : n.chip || "-"),
    el("td", {}, n.lastSeenSecondsAgo == null ? "-" : `${n.lastSeenSecondsAgo} s ago`))));
}

function renderRequests() {
  const reqs = state.status.requests || [];
  $("#requests-empty").hidden = reqs.length > 0;
  $("#requests-table tbody").replaceChildren(...reqs.map((r) => el("tr", {},
    el("td", { title: r.request_id }, r.request_id.slice(0, 16)), el("td", {}, r.model),
    el("td", {}, r.phase), el("td", {}, r.progress != null ? `${Math.round(r.progress * 100)}%` : "-"),
    el("td", {}, secs(r.ttft_s)), el("td", {}, r.tokens_per_second ?? "-"),
    el("td", {}, r.cache_hit_type || "-"), el("td", {}, String(r.prompt_tokens)),
    el("td", {}, String(r.generated_tokens)), el("td", {}, secs(r.elapsed_s)))));
}

function chart(canvas, points, color) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  canvas.width = w * dpr; canvas.height = h * dpr;
  const g = canvas.getContext("2d");
  g.scale(dpr, dpr);
  const css = getComputedStyle(document.documentElement);
  const vals = points.filter((p) => p != null);
  if (!vals.length) {
    g.fillStyle = css.getPropertyValue("--muted"); g.font = "13px system-ui";
    g.fillText("no data yet", w / 2 - 35, h / 2);
    return;
  }
  const max = Math.max(1e-9, ...vals) * 1.15;
  g.strokeStyle = css.getPropertyValue("--line"); g.lineWidth = 1;
  g.fillStyle = css.getPropertyValue("--muted"); g.font = "11px system-ui";
  for (const f of [0, 0.5, 1]) {
    const y = h - 16 - f * (h - 24);
    g.beginPath(); g.moveTo(36, y); g.lineTo(w, y); g.stroke();
    g.fillText((max * f).toPrecision(2), 0, y + 4);
  }
  g.fillText("-5 min", 36, h - 2); g.fillText("now", w - 24, h - 2);
  // A line through consecutive samples; a dot for a sample with no neighbour (TTFT is
  // only known when a request starts, so its series has gaps).
  g.strokeStyle = color; g.fillStyle = color; g.lineWidth = 2;
  const at = (v, i) => [36 + (i / Math.max(1, HISTORY - 1)) * (w - 36),
    h - 16 - (v / max) * (h - 24)];
  g.beginPath();
  points.forEach((v, i) => {
    if (v == null) return;
    const [x, y] = at(v, i);
    if (points[i - 1] != null) g.lineTo(x, y); else g.moveTo(x, y);
    if (points[i - 1] == null && points[i + 1] == null) g.fillRect(x - 2, y - 2, 4, 4);
  });
  g.stroke();
}

function renderMetrics() {
  const pad = Array(Math.max(0, HISTORY - state.history.length)).fill(null);
  const css = getComputedStyle(document.documentElement);
  chart($("#chart-tps"), [...pad, ...state.history.map((p) => p.tps)], css.getPropertyValue("--accent"));
  chart($("#chart-ttft"), [...pad, ...state.history.map((p) => p.ttft)], css.getPropertyValue("--warn"));
  chart($("#chart-mem"), [...pad, ...state.history.map((p) => p.mem)], css.getPropertyValue("--ok"));
}

// ---- chat ----------------------------------------------------------------------------

const chat = { messages: [], abort: null };

function renderChatModels() {
  const sel = $("#chat-model");
  const names = state.models.items.flatMap((m) => [m.name, ...m.aliases]);
  const have = [...sel.options].map((o) => o.value);
  if (have.join() === names.join()) return;
  const keep = sel.value;
  sel.replaceChildren(...names.map((n) => el("option", { value: n }, n)));
  if (names.includes(keep)) sel.value = keep;
}

function bubble(role, text = "") {
  const b = el("div", { class: `msg ${role}` });
  const body = el("div", { class: "body" }, text);
  b.append(body);
  $("#chat-log").append(b);
  b.scrollIntoView({ block: "end" });
  return { b, body };
}

async function send(text) {
  chat.messages.push({ role: "user", content: text });
  bubble("user", text);
  const { b, body } = bubble("assistant");
  let answer = "", reasoning = "", reasoningEl = null;
  const calls = [];
  const sys = $("#chat-system").value.trim();
  const messages = sys ? [{ role: "system", content: sys }, ...chat.messages] : chat.messages;
  chat.abort = new AbortController();
  $("#chat-stop").hidden = false; $("#chat-send").disabled = true;
  const t0 = performance.now();
  let first = null, usage = null, finish = null;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", signal: chat.abort.signal,
      headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify({
        model: $("#chat-model").value, messages, stream: true,
        temperature: Number($("#chat-temp").value), max_tokens: Number($("#chat-max").value),
        stream_options: { include_usage: true },
      }),
    });
    if (r.status === 401) { askKey(); throw new Error("API key required"); }
    if (!r.ok) throw new Error(errorText(await r.json().catch(() => null)) || `HTTP ${r.status}`);
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, i); buf = buf.slice(i + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
          const chunk = JSON.parse(line.slice(6));
          if (chunk.error) throw new Error(chunk.error.message);
          if (chunk.usage) usage = chunk.usage;
          const c = chunk.choices?.[0];
          if (!c) continue;
          if (c.finish_reason) finish = c.finish_reason;
          const d = c.delta || {};
          if (first == null && (d.content || d.reasoning || d.tool_calls)) first = performance.now();
          if (d.reasoning) {
            if (!reasoningEl) {
              reasoningEl = el("details", {}, el("summary", {}, "Reasoning"), el("div"));
              b.insertBefore(reasoningEl, body);
            }
            reasoning += d.reasoning;
            reasoningEl.lastChild.textContent = reasoning;
          }
          if (d.content) { answer += d.content; body.textContent = answer; }
          for (const tc of d.tool_calls || []) {
            const k = tc.index ?? calls.length;
            calls[k] = calls[k] || { name: "", arguments: "" };
            if (tc.function?.name) calls[k].name = tc.function.name;
            if (tc.function?.arguments) calls[k].arguments += tc.function.arguments;
          }
        }
      }
      b.scrollIntoView({ block: "end" });
    }
  } catch (e) {
    if (e.name !== "AbortError") b.append(el("div", { class: "error" }, e.message));
    else finish = "stopped";
  } finally {
    chat.abort = null;
    $("#chat-stop").hidden = true; $("#chat-send").disabled = false;
  }
  for (const c of calls) b.append(el("div", { class: "tool" }, `tool call: ${c.name}(${c.arguments})`));
  const seconds = (performance.now() - (first ?? t0)) / 1000;
  const n = usage?.completion_tokens;
  const parts = [];
  if (n != null) parts.push(`${n} tokens`, `${(n / Math.max(seconds, 1e-3)).toFixed(1)} tok/s`);
  if (first != null) parts.push(`first token ${secs((first - t0) / 1000)}`);
  if (finish) parts.push(finish);
  b.append(el("div", { class: "meta" }, parts.join(" · ")));
  chat.messages.push({ role: "assistant", content: answer });
}

$("#chat-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("#chat-input").value.trim();
  if (!text || chat.abort) return;
  $("#chat-input").value = "";
  send(text);
});
$("#chat-input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("#chat-form").requestSubmit(); }
});
$("#chat-stop").addEventListener("click", () => chat.abort?.abort());
$("#chat-clear").addEventListener("click", () => { chat.messages = []; $("#chat-log").replaceChildren(); });

// ---- start -------------------------------------------------------------------------

window.addEventListener("hashchange", () => {
  if (route().page !== "model" && follow) { follow.abort.abort(); follow = null; }
  render();
});
render();
poll();
setInterval(poll, 1000);
setInterval(() => { if (route().page === "models" && state.models) renderModels(); }, 1000);
