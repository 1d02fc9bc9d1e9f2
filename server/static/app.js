// pyengine's web page: a streaming chat playground, a live panel fed by GET /stats, and the
// memory plan. Plain browser JavaScript: no build step, no external assets.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_ITEM = "pyengine-api-key";
let model = null;
let history = [];
let controller = null;

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY_ITEM);
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// Resolves once /v1/models answers; asks for the API key (kept in sessionStorage) on a 401.
async function connect() {
  for (;;) {
    const r = await fetch("/v1/models", { headers: headers() });
    if (r.status === 401) {
      sessionStorage.removeItem(KEY_ITEM);
      await askKey();
      continue;
    }
    const body = await r.json();
    model = body.data[0].id;
    $("model").textContent = model + " · context " + body.data[0].max_model_len + " tokens";
    return;
  }
}

function askKey() {
  return new Promise((resolve) => {
    const dlg = $("key-dialog");
    $("key-form").onsubmit = () => {
      sessionStorage.setItem(KEY_ITEM, $("key-input").value);
      resolve();
    };
    dlg.showModal();
  });
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

// Streams one chat completion into a new assistant message (SSE over fetch).
async function send(ev) {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const out = addMessage("assistant", "");
  out.id = "answer-" + history.length;
  out.classList.add("streaming");
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  let answer = "";
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({ model, messages: history, stream: true,
                             max_tokens: +$("max-tokens").value, temperature: +$("temperature").value }),
    });
    if (!r.ok) throw new Error((await r.json()).error.message);
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const line = buf.slice(0, i).trim();
        buf = buf.slice(i + 2);
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const chunk = JSON.parse(line.slice(6));
        if (chunk.error) throw new Error(chunk.error.message);
        for (const c of chunk.choices) {
          if (c.delta && c.delta.content) {
            answer += c.delta.content;
            out.textContent = answer;
          }
        }
      }
    }
    history.push({ role: "assistant", content: answer });
  } catch (e) {
    if (e.name !== "AbortError") addMessage("error", String(e.message || e));
    history.pop();
  } finally {
    out.classList.remove("streaming");
    out.classList.add("done");
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

const fmt = (v, digits = 1) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits));
const ms = (v) => (v === null || v === undefined ? "–" : (1000 * v).toFixed(0));

function chart(canvas, series, colors, label, max) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  const top = max || Math.max(1e-9, ...series.flat());
  ctx.fillStyle = "#5a6070";
  ctx.font = "11px sans-serif";
  ctx.fillText(label + " (max " + fmt(top) + ")", 6, 12);
  series.forEach((ys, k) => {
    ctx.strokeStyle = colors[k];
    ctx.beginPath();
    ys.forEach((y, i) => {
      const x = ys.length < 2 ? 0 : (i / (ys.length - 1)) * w;
      const py = h - 4 - (y / top) * (h - 20);
      i ? ctx.lineTo(x, py) : ctx.moveTo(x, py);
    });
    ctx.stroke();
  });
}

async function refreshStats() {
  try {
    const r = await fetch("/stats", { headers: headers() });
    if (!r.ok) return;
    const s = await r.json();
    const live = s.live, last = live.series[live.series.length - 1];
    if (last) {
      $("s-gen").textContent = fmt(last.generation_tps);
      $("s-prompt").textContent = fmt(last.prompt_tps);
      $("s-running").textContent = last.running;
      $("s-waiting").textContent = last.waiting;
      $("s-kv").textContent = fmt(100 * last.kv_usage) + "%";
      $("s-hit").textContent = last.prefix_hit_rate === null ? "–" : fmt(100 * last.prefix_hit_rate) + "%";
      $("s-disk").textContent = last.disk_hit_rate === null ? "–" : fmt(100 * last.disk_hit_rate) + "%";
    }
    $("s-ttft").textContent = ms(live.latency.ttft.p50) + " / " + ms(live.latency.ttft.p95) + " ms";
    $("s-tpot").textContent = ms(live.latency.tpot.p50) + " / " + ms(live.latency.tpot.p95) + " ms";
    showSpec(live.spec);
    chart($("chart-tps"), [live.series.map((x) => x.generation_tps), live.series.map((x) => x.prompt_tps)],
          ["#1a73e8", "#e8710a"], "tokens/s: output (blue), prompt (orange), last " + live.window_s + " s");
    chart($("chart-kv"), [live.series.map((x) => 100 * x.kv_usage)], ["#188038"], "KV cache %", 100);
    const n = +$("stats-updates").dataset.count + 1;
    $("stats-updates").dataset.count = n;
    $("stats-updates").textContent = "updated " + new Date().toLocaleTimeString() + " · " +
      live.requests + " requests in the window";
    if (s.plan) showPlan(s.plan);
  } catch (e) {
    $("status").textContent = "stats: " + e;
  }
}

// Speculative decoding over the window; the server sends none when it is off and never drafted.
function showSpec(spec) {
  $("spec").hidden = !spec;
  if (!spec) return;
  $("s-draft").textContent = spec.draft_tokens;
  $("s-accepted").textContent = spec.accepted_tokens;
  $("s-accept-rate").textContent = spec.acceptance_rate === null ? "–" : fmt(100 * spec.acceptance_rate) + "%";
  $("s-accept-len").textContent = fmt(spec.mean_accepted_length, 2);
}

function showPlan(p) {
  const mib = (b) => (b / 2 ** 20).toFixed(1) + " MiB";
  const rows = [
    ["weights", mib(p.weight_bytes) + " (" + p.dtype + ")"],
    ["KV cache", mib(p.kv_bytes) + " (" + p.kv_cache_dtype + ")"],
    ["KV bytes per token", p.kv_bytes_per_token],
    ["KV blocks × block size", p.num_blocks + " × " + p.block_size],
    ["tokens that fit", p.kv_tokens],
    ["sequences at full context (" + p.max_model_len + ")", p.max_sequences_full_context],
    ["activation reserve", mib(p.activation_reserve_bytes)],
  ];
  const body = $("plan").tBodies[0];
  body.replaceChildren(...rows.map(([k, v]) => {
    const tr = document.createElement("tr");
    tr.innerHTML = "<td></td><td></td>";
    tr.cells[0].textContent = k;
    tr.cells[1].textContent = v;
    return tr;
  }));
}

$("chat-form").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) send(e);
});
$("stop").onclick = () => controller && controller.abort();
$("clear").onclick = () => { history = []; $("messages").replaceChildren(); };

connect().then(() => {
  $("status").textContent = "connected";
  refreshStats();
  setInterval(refreshStats, 1000);
});
