// The hybridkv page: a streaming chat over /v1/chat/completions and a live view of /stats.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];
let model = null;
let busy = null;   // AbortController of the reply being streamed

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function human(n) {
  if (n === undefined || n === null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + units[i];
}

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text || "";
  div.appendChild(content);
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

async function send(text) {
  history.push({ role: "user", content: text });
  bubble("user", text);
  const div = bubble("assistant", "");
  div.classList.add("streaming");
  const content = div.querySelector(".content");
  let reasoning = null, answer = "", thought = "", usage = null, finish = null;
  const body = {
    model, messages: history, stream: true, stream_options: { include_usage: true },
    max_tokens: parseInt($("max-tokens").value, 10) || 64,
    temperature: parseFloat($("temperature").value),
    chat_template_kwargs: { thinking: $("thinking").checked },
  };
  busy = new AbortController();
  $("send").textContent = "stop";
  const t0 = performance.now();
  let ttft = null;
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body), signal: busy.signal });
    if (!r.ok) {
      const err = await r.json().catch(() => ({ error: { message: r.statusText } }));
      throw new Error(`${r.status}: ${err.error.message}`);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const line = buf.slice(0, cut).trim();
        buf = buf.slice(cut + 2);
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") continue;
        const obj = JSON.parse(data);
        if (obj.error) throw new Error(obj.error.message);
        if (obj.usage) usage = obj.usage;
        for (const ch of obj.choices || []) {
          const d = ch.delta || {};
          if (d.reasoning_content) {
            if (!reasoning) {
              reasoning = document.createElement("details");
              reasoning.open = true;
              reasoning.innerHTML = "<summary>reasoning</summary><div></div>";
              div.insertBefore(reasoning, content);
            }
            thought += d.reasoning_content;
            reasoning.lastChild.textContent = thought;
          }
          if (d.content) { answer += d.content; content.textContent = answer; }
          if ((d.content || d.reasoning_content) && ttft === null) ttft = performance.now() - t0;
          if (d.tool_calls) content.textContent += "\n[tool call] " + JSON.stringify(d.tool_calls);
          if (ch.finish_reason) finish = ch.finish_reason;
        }
        $("messages").scrollTop = $("messages").scrollHeight;
      }
    }
    history.push({ role: "assistant", content: answer });
    const meta = document.createElement("div");
    meta.className = "meta";
    const secs = (performance.now() - t0) / 1000;
    meta.textContent = usage
      ? `${usage.completion_tokens} tokens in ${secs.toFixed(2)} s · TTFT ${ttft === null ? "–" : ttft.toFixed(0) + " ms"} · prompt ${usage.prompt_tokens} (cached ${usage.prompt_tokens_details.cached_tokens}) · ${finish}`
      : `stopped after ${secs.toFixed(2)} s`;
    div.appendChild(meta);
  } catch (e) {
    if (e.name === "AbortError") {
      history.push({ role: "assistant", content: answer });
    } else {
      history.pop();
      div.classList.add("error");
      content.textContent = (answer ? answer + "\n" : "") + "error: " + e.message;
    }
  } finally {
    div.classList.remove("streaming");
    div.classList.add("done");
    busy = null;
    $("send").textContent = "send";
  }
}

function count(n) {
  return n === undefined || n === null ? "–" : String(n);
}

// the prefix-cache tiers below the device (host DRAM, disk, Redis): what each holds and its counters
function renderTiers(tiers) {
  const rows = Object.entries(tiers).map(([tier, u]) =>
    `<tr data-tier="${tier}" data-bytes="${u.bytes ?? ""}" data-hits="${u.hits}" data-evictions="${u.evictions}">` +
    `<td>${tier}</td><td>${human(u.bytes)}</td><td>${human(u.capacity)}</td><td>${count(u.entries)}</td>` +
    `<td>${count(u.hits)}</td><td>${count(u.misses)}</td><td>${count(u.evictions)}</td><td>${count(u.expired)}</td></tr>`);
  document.querySelector("#tier-table tbody").innerHTML =
    rows.length ? rows.join("") : `<tr><td colspan="8">none: the prefix cache lives on the device only</td></tr>`;
}

async function refresh() {
  try {
    const r = await fetch("/stats", { headers: headers() });
    if (r.status === 401) {
      $("status").textContent = "enter the API key to see the server's state";
      $("status").className = "pill bad";
      return;
    }
    const s = await r.json();
    const m = s.memory;
    model = s.model;
    $("model").textContent = s.model;
    $("status").textContent = s.engine_alive ? "ready" : "engine stopped";
    $("status").className = "pill " + (s.engine_alive ? "ok" : "bad");
    $("running").textContent = m.requests.running;
    $("waiting").textContent = m.requests.waiting;
    $("preemptions").textContent = m.preemptions;
    const t = s.totals;
    $("hit-rate").textContent = t.prompt_tokens ? (100 * t.cached_prompt_tokens / t.prompt_tokens).toFixed(1) + "%" : "–";
    const b = m.blocks;
    $("blocks").textContent = `${b.active} held, ${b.cached} cached, ${b.total} total (${b.block_tokens} tokens each)`;
    $("bar-active").style.width = (100 * b.active / b.total) + "%";
    $("bar-cached").style.width = (100 * b.cached / b.total) + "%";
    const rows = [];
    let act = 0, cac = 0, cap = 0;
    for (const [tier, kinds] of Object.entries(m.tiers)) {
      for (const [kind, v] of Object.entries(kinds)) {
        rows.push(`<tr><td>${tier}</td><td>${kind}</td><td>${human(v.active)}</td><td>${human(v.cached)}</td><td>${human(v.capacity)}</td></tr>`);
        act += v.active; cac += v.cached; cap += v.capacity;
      }
    }
    document.querySelector("#mem-table tbody").innerHTML = rows.join("");
    $("kv-active-total").textContent = human(act);
    $("kv-active-total").dataset.bytes = act;
    $("kv-cached-total").textContent = human(cac);
    $("kv-cached-total").dataset.bytes = cac;
    $("kv-capacity-total").textContent = human(cap);
    renderTiers(m.lower_tiers || {});
    $("config").textContent = `KV format ${m.kv_format} · window policy ${m.window_policy} · prefix caching ${m.prefix_caching ? "on" : "off"} · ${m.slots.total - m.slots.free}/${m.slots.total} slots in use · ${b.evictions} evictions`;
    $("tokens").textContent = `${t.prompt_tokens} prompt tokens (${t.cached_prompt_tokens} from the prefix cache) · ${t.generation_tokens} generated · ${t.requests} requests`;
  } catch (e) {
    $("status").textContent = "unreachable";
    $("status").className = "pill bad";
  }
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  if (busy) { busy.abort(); return; }
  const text = $("input").value.trim();
  if (!text) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
});
$("clear").addEventListener("click", () => { history.length = 0; $("messages").innerHTML = ""; });
$("api-key").value = localStorage.getItem("hybridkv-api-key") || "";
$("api-key").addEventListener("change", () => localStorage.setItem("hybridkv-api-key", $("api-key").value));
refresh();
setInterval(refresh, 1000);
