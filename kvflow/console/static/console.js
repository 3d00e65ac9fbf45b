// kvflow's live console: polls GET /v1/kvflow/state a few times a second and draws the
// engine (requests, the KV pool's blocks, the last steps, counters); chats with the model
// through /v1/chat/completions (streamed). Plain JavaScript, no build step, no network access
// beyond this server. With an API key, the browser's HTTP Basic login opens the page and
// /console/token only: the API routes take the console token that route gives, sent as a
// Bearer key (a page of another site can neither read it nor send it).
"use strict";

const POLL_MS = 333;  // three updates a second
const WINDOW_S = 60;
const COLORS = { ".": "--free", c: "--cached", o: "--owned", s: "--shared" };
const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();
const $ = (id) => document.getElementById(id);

let model = null;
let token;  // undefined: not asked yet; null: the server has no key
let last = null;  // the last snapshot drawn (of the first server)
const ttfts = [];  // [seen at (ms), ttft (ms)] of requests whose first token came
const seenFirst = new Set();

function percentile(values, p) {
  if (!values.length) return null;
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.floor(p * sorted.length))];
}
const ms = (v) => (v === null ? "-" : v.toFixed(0));

// This server's URL of a path: from location.origin, which never holds the user name and
// password of a page opened as http://user:key@host/ (fetch refuses a URL that does).
const here = (path) => new URL(path, location.origin);

// fetch() of an API route, with the console token when the server has a key.
async function api(path, init = {}) {
  if (token === undefined) {
    const r = await fetch(here("/console/token"), { cache: "no-store" });
    token = r.ok ? (await r.json()).token : null;
  }
  const headers = { ...(init.headers || {}) };
  if (token) headers.Authorization = `Bearer ${token}`;
  return fetch(here(path), { ...init, headers });
}

async function poll() {
  try {
    const r = await api("/v1/kvflow/state", { cache: "no-store" });
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    const body = await r.json();
    const server = body.servers[0];
    if (server.error) throw new Error(server.error);
    draw(server);
    $("status").textContent = `${body.servers.length} server(s), updated ` +
      new Date().toLocaleTimeString();
  } catch (e) {
    $("status").textContent = `state unavailable: ${e.message}`;
  }
}

function draw(state) {
  last = state;
  const now = Date.now();
  for (const r of state.requests) {
    if (r.output_tokens > 0 && !seenFirst.has(r.id)) {
      seenFirst.add(r.id);
      ttfts.push([now, 1e3 * r.ttft_s]);
    }
  }
  while (ttfts.length && ttfts[0][0] < now - WINDOW_S * 1e3) ttfts.shift();
  drawCounters(state);
  drawLoras(state.loras || []);
  drawTiers(state.tiers || []);
  drawRequests(state);
  drawKV(state.kv);
  drawSteps(state.steps);
}

function drawCounters(state) {
  const recent = state.steps.filter((s) => s.time >= state.time - WINDOW_S);
  const span = recent.length > 1 ? recent[recent.length - 1].time - recent[0].time : 0;
  const tokens = recent.slice(1).reduce((n, s) => n + s.prefill + s.decode, 0);
  $("c-throughput").textContent = span > 0 ? (tokens / span).toFixed(0) : "0";
  const t = ttfts.map((x) => x[1]);
  $("c-ttft").textContent = `${ms(percentile(t, 0.5))} / ${ms(percentile(t, 0.99))}`;
  const gaps = recent.slice(1).map((s, i) => 1e3 * (s.time - recent[i].time));
  $("c-itl").textContent = `${ms(percentile(gaps, 0.5))} / ${ms(percentile(gaps, 0.99))}`;
  const c = state.counters;
  $("c-hit").textContent = c.prefix_cache_queries
    ? `${((100 * c.prefix_cache_hits) / c.prefix_cache_queries).toFixed(1)}%` : "-";
  $("c-kv").textContent = `${(100 * state.kv.usage).toFixed(1)}%`;
  $("c-queue").textContent = `${state.num_running} / ${state.num_waiting}`;
}

function drawRequests(state) {
  const body = $("requests").querySelector("tbody");
  body.replaceChildren(...state.requests.map((r) => {
    const row = document.createElement("tr");
    row.dataset.state = r.state;
    const prefill = r.state === "prefill" || r.state === "waiting";
    const done = prefill ? r.computed_tokens : r.output_tokens;
    const total = prefill ? r.prompt_tokens : r.max_tokens;
    const cells = [r.id, null, null, r.tenant ?? "", r.lora_name ?? "", r.priority,
                   (1e3 * r.ttft_s).toFixed(0), r.blocks];
    cells.forEach((value, i) => {
      const td = document.createElement("td");
      if (i === 0) { td.className = "id"; td.title = value; td.textContent = value; }
      else if (i === 1) {
        const badge = document.createElement("span");
        badge.className = `badge ${r.state}`;
        badge.textContent = r.state;
        td.append(badge);
      } else if (i === 2) {
        const bar = document.createElement("div");
        bar.className = `bar ${prefill ? "prefill" : ""}`;
        const fill = document.createElement("div");
        fill.style.width = `${Math.min(100, (100 * done) / Math.max(1, total))}%`;
        bar.append(fill);
        bar.title = `${done} / ${total} ${prefill ? "prompt" : "output"} tokens`;
        td.append(bar);
      } else td.textContent = value;
      row.append(td);
    });
    return row;
  }));
  const more = state.num_running + state.num_waiting - state.requests.length;
  if (more > 0) {
    const row = document.createElement("tr");
    row.innerHTML = `<td colspan="8" class="muted">and ${more} more</td>`;
    body.append(row);
  }
}

// The KV tiers below the pool (host "cpu", "disk"): fill, blocks restored, corrupt files.
function drawTiers(tiers) {
  const line = $("tiers");
  line.hidden = tiers.length === 0;
  const mib = (b) => (b / 1048576).toFixed(1);
  line.textContent = "KV tiers: " + tiers.map((t) =>
    `${t.medium} ${mib(t.bytes)}/${mib(t.capacity_bytes)} MiB, ${t.blocks} blocks, ` +
    `${t.hits} restored` + (t.corrupt ? `, ${t.corrupt} corrupt` : "")
  ).join("; ");
}

// The LoRA adapters loaded (name, slot, running sequences), and the chat's model choices: the
// base model, then each adapter.
function drawLoras(loras) {
  const line = $("loras");
  line.hidden = loras.length === 0;
  line.textContent = "LoRA adapters: " + loras.map((a) =>
    `${a.name} (${a.resident ? `slot ${a.slot}` : "not resident"}, ${a.running} running)`
  ).join(", ");
  const names = [model, ...loras.map((a) => a.name)].filter((n) => n);
  const select = $("chat-model");
  if ([...select.options].map((o) => o.value).join("\n") === names.join("\n")) return;
  const chosen = select.value;
  select.replaceChildren(...names.map((n) => new Option(n, n, false, n === chosen)));
}

function drawKV(kv) {
  const canvas = $("kv");
  const n = kv.cells.length;
  const cols = Math.ceil(Math.sqrt(n * (canvas.width / canvas.height)));
  const size = canvas.width / cols;
  const rows = Math.ceil(n / cols);
  canvas.height = Math.max(20, Math.ceil(rows * size));
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  for (let i = 0; i < n; i++) {
    ctx.fillStyle = css(COLORS[kv.cells[i]]);
    ctx.fillRect((i % cols) * size + 0.5, Math.floor(i / cols) * size + 0.5,
                 Math.max(1, size - 1), Math.max(1, size - 1));
  }
  canvas.dataset.used = String(kv.owned + kv.shared);
  canvas.dataset.cols = String(cols);
  canvas.dataset.size = String(size);
  canvas.title = `${kv.num_blocks} blocks of ${kv.block_size} tokens` +
    (kv.blocks_per_cell > 1 ? `, ${kv.blocks_per_cell} per cell` : "");
}

$("kv").addEventListener("mousemove", (event) => {
  const canvas = $("kv");
  const tip = $("kv-tip");
  if (!last) return;
  const rect = canvas.getBoundingClientRect();
  const scale = canvas.width / rect.width;
  const size = Number(canvas.dataset.size);
  const cols = Number(canvas.dataset.cols);
  const col = Math.floor(((event.clientX - rect.left) * scale) / size);
  const row = Math.floor(((event.clientY - rect.top) * scale) / size);
  const i = row * cols + col;
  const kv = last.kv;
  if (col >= cols || i >= kv.cells.length) { tip.hidden = true; return; }
  const owner = kv.owner[i] >= 0 ? last.requests[kv.owner[i]].id : "-";
  const what = { ".": "free", c: "cached (evictable)", o: "owned", s: "shared" }[kv.cells[i]];
  const first = i * kv.blocks_per_cell + 1;
  tip.textContent = `block ${first}${kv.blocks_per_cell > 1 ? "+" : ""}: ${what}, ` +
    `refs ${kv.refs[i]}, owner ${owner}`;
  tip.style.left = `${event.clientX - rect.left + 12}px`;
  tip.style.top = `${event.clientY - rect.top + 12}px`;
  tip.hidden = false;
});
$("kv").addEventListener("mouseleave", () => { $("kv-tip").hidden = true; });

function drawSteps(steps) {
  const canvas = $("steps");
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  if (!steps.length) return;
  const peak = Math.max(1, ...steps.map((s) => s.prefill + s.decode + s.spec));
  const width = canvas.width / Math.max(steps.length, 60);
  const h = canvas.height - 12;
  steps.forEach((s, i) => {
    const x = i * width;
    let y = canvas.height;
    for (const [count, color] of [[s.decode, "--decode"], [s.spec, "--spec"],
                                  [s.prefill, "--prefill"]]) {
      const bar = (h * count) / peak;
      ctx.fillStyle = css(color);
      ctx.fillRect(x, y - bar, Math.max(1, width - 1), bar);
      y -= bar;
    }
    if (s.preempted) {
      ctx.fillStyle = css("--preempt");
      ctx.fillRect(x, 0, Math.max(2, width - 1), 8);
    }
  });
  const s = steps[steps.length - 1];
  $("step-info").textContent = `last step: ${s.prefill} prefill + ${s.decode} decode tokens` +
    `${s.spec ? ` + ${s.spec} drafts` : ""}, batch ${s.batch}, ${s.step_ms.toFixed(1)} ms` +
    ` (bars: tokens per step, tallest ${peak})`;
}

// --- chat ---------------------------------------------------------------------------------

async function modelName() {
  if (model) return model;
  const r = await api("/v1/models");
  model = (await r.json()).data[0].id;
  $("model").textContent = model;
  drawLoras(last ? last.loras || [] : []);
  return model;
}

function request(messages) {
  const body = {
    model: $("chat-model").value || model, messages, stream: true, stream_options: { include_usage: true },
    max_tokens: Number($("max_tokens").value) || 128,
    temperature: Number($("temperature").value), top_p: Number($("top_p").value),
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  const schema = $("schema").value.trim();
  if (schema) {
    body.response_format = { type: "json_schema",
                             json_schema: { name: "console", schema: JSON.parse(schema) } };
  }
  return body;
}

async function chatOnce(body, card) {
  const text = card.querySelector("pre");
  const stats = card.querySelector(".stats");
  const start = performance.now();
  const arrivals = [];
  let usage = null;
  const r = await api("/v1/chat/completions", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  if (!r.ok) {
    const error = await r.json().catch(() => ({ error: { message: `HTTP ${r.status}` } }));
    throw new Error(error.error.message);
  }
  const reader = r.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      if (!event.startsWith("data: ") || event === "data: [DONE]") continue;
      const chunk = JSON.parse(event.slice(6));
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const piece = choice.delta.content || "";
        if (piece) { text.textContent += piece; arrivals.push(performance.now()); }
      }
    }
  }
  const ttft = arrivals.length ? arrivals[0] - start : null;
  const gaps = arrivals.slice(1).map((t, i) => t - arrivals[i]);
  const itl = gaps.length ? gaps.reduce((a, b) => a + b, 0) / gaps.length : null;
  stats.textContent = `TTFT ${ms(ttft)} ms, ITL ${itl === null ? "-" : itl.toFixed(1)} ms, ` +
    `${usage ? usage.completion_tokens : "?"} tokens`;
}

async function send() {
  const prompt = $("prompt").value.trim();
  if (!prompt) return;
  await modelName();
  const messages = [];
  if ($("system").value.trim()) messages.push({ role: "system", content: $("system").value });
  messages.push({ role: "user", content: prompt });
  let body;
  try { body = request(messages); } catch (e) { alert(`JSON schema: ${e.message}`); return; }
  const n = Math.max(1, Math.min(16, Number($("parallel").value) || 1));
  const cards = [];
  for (let i = 0; i < n; i++) {
    const card = document.createElement("div");
    card.className = "reply";
    card.dataset.done = "false";
    card.innerHTML = `<div class="muted"></div><pre></pre><div class="stats">waiting...</div>`;
    card.querySelector(".muted").textContent = `${prompt}${n > 1 ? ` (#${i + 1})` : ""}`;
    $("replies").prepend(card);
    cards.push(card);
  }
  await Promise.all(cards.map(async (card) => {
    try { await chatOnce(body, card); } catch (e) {
      card.classList.add("error");
      card.querySelector(".stats").textContent = e.message;
    }
    card.dataset.done = "true";
  }));
}

$("send").addEventListener("click", send);
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
});
modelName().catch(() => {});
poll();
setInterval(poll, POLL_MS);
