// Capy Flash dashboard: plain JS over the server's /admin endpoints (polling, no reloads).
"use strict";
const $ = (id) => document.getElementById(id);
const origin = window.CAPY_ENDPOINT || window.location.origin;

function key() { return localStorage.getItem("capy-ui-key") || ""; }
async function api(path, body) {
  const headers = {};
  if (key()) headers["Authorization"] = "Bearer " + key();
  const init = { headers };
  if (body !== undefined) { init.method = "POST"; headers["Content-Type"] = "application/json"; init.body = JSON.stringify(body); }
  const r = await fetch(origin + path, init);
  const text = await r.text();
  let data = null; try { data = JSON.parse(text); } catch (_) { data = { raw: text }; }
  if (!r.ok) throw new Error((data && data.error && data.error.message) || (r.status + " " + text));
  return data;
}

const GB = 1e9, GiB = 1 << 30;
const gib = (b) => b == null ? "—" : (b / GiB).toFixed(1) + " GiB";
function bytes(b) {
  if (b == null) return "—";
  if (b >= GB) return (b / GB).toFixed(2) + " GB";
  if (b >= 1e6) return (b / 1e6).toFixed(1) + " MB";
  if (b >= 1e3) return (b / 1e3).toFixed(1) + " kB";
  return b + " B";
}
function duration(s) {
  if (s == null || !isFinite(s)) return "—";
  s = Math.round(s); if (s < 60) return s + " s";
  const m = Math.floor(s / 60); if (m < 60) return m + " min " + (s % 60) + " s";
  return Math.floor(m / 60) + " h " + (m % 60) + " min";
}
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k.startsWith("on")) e.addEventListener(k.slice(2), v); else e.setAttribute(k, v);
  }
  for (const k of kids) if (k != null) e.append(k instanceof Node ? k : String(k));
  return e;
}
function setBar(id, frac) { $(id).style.width = Math.max(0, Math.min(1, frac || 0)) * 100 + "%"; }

// --- Server and agent setup snippets -------------------------------------------------------
function snippets(model) {
  $("endpoint").textContent = origin;
  $("snip-claude-env").textContent =
    `export ANTHROPIC_BASE_URL=${origin}\nexport ANTHROPIC_AUTH_TOKEN=${key() || "local"}\nclaude`;
  $("snip-claude-settings").textContent = JSON.stringify(
    { env: { ANTHROPIC_BASE_URL: origin, ANTHROPIC_AUTH_TOKEN: key() || "local" } }, null, 2);
  $("snip-codex").textContent =
    `model = "${model}"\nmodel_provider = "capy"\n\n[model_providers.capy]\nname = "Capy Flash"\nbase_url = "${origin}/v1"\nwire_api = "responses"` +
    (key() ? `\nenv_key = "CAPY_API_KEY"` : "");
  $("snip-opencode").textContent = JSON.stringify({
    provider: { capy: { npm: "@ai-sdk/openai-compatible", name: "Capy Flash",
      options: { baseURL: origin + "/v1" }, models: { [model]: { name: "Capy Flash (local)" } } } },
    model: "capy/" + model }, null, 2);
}
async function copyText(text) {
  try { await navigator.clipboard.writeText(text); return true; } catch (_) {
    const t = el("textarea", {}); t.value = text; document.body.append(t); t.select();
    const ok = document.execCommand("copy"); t.remove(); return ok;
  }
}
document.addEventListener("click", async (ev) => {
  const b = ev.target.closest("[data-copy]");
  if (b) {
    const ok = await copyText($(b.dataset.copy).textContent);
    $("copied").textContent = ok ? "Copied to the clipboard." : "Copy failed: select the text and copy it.";
  }
  const t = ev.target.closest("[data-tab]");
  if (t) {
    document.querySelectorAll("[data-tab]").forEach((x) => x.classList.toggle("active", x === t));
    document.querySelectorAll("[data-pane]").forEach((p) => p.classList.toggle("hidden", p.dataset.pane !== t.dataset.tab));
  }
});

let modelId = "capy-flash";
async function pollState() {
  try {
    const h = await api("/health");
    modelId = h.model || modelId;
    $("state").textContent = "ready"; $("state").className = "badge ready";
    $("model").textContent = "serving " + modelId;
  } catch (e) {
    $("state").textContent = "unreachable"; $("state").className = "badge error";
    $("model").textContent = String(e.message || e);
  }
  snippets(modelId);
}

// --- Machine --------------------------------------------------------------------------------
async function pollMachine() {
  try {
    const m = await api("/admin/machine");
    $("ram").textContent = `${gib(m.ram.used_bytes)} used of ${gib(m.ram.total_bytes)} (${gib(m.ram.available_bytes)} available)`;
    setBar("ram-bar", m.ram.used_bytes / m.ram.total_bytes);
    $("cpu").textContent = `${m.cpu.usage_percent.toFixed(0)} % of ${m.cpu.cores} cores`;
    setBar("cpu-bar", m.cpu.usage_percent / 100);
    const locked = m.page_locked.locked_bytes || 0;
    $("locked").textContent = `${gib(locked)} locked of ${gib(m.page_locked.cap_bytes)} allowed`;
    setBar("locked-bar", m.page_locked.cap_bytes ? locked / m.page_locked.cap_bytes : 0);
    $("rss").textContent = `${gib(m.process.resident_bytes)} resident, weights ${bytes(m.server.weight_bytes)}`;
    const g = $("gpus"); g.replaceChildren();
    if (!m.gpus.length) g.append(el("div", { class: "muted" }, "GPUs: " + (m.gpu_note || "none")));
    for (const x of m.gpus) {
      const bar = el("div", {}); bar.style.width = (x.used_vram_bytes / x.total_vram_bytes * 100 || 0) + "%";
      g.append(el("div", { class: "meter" }, el("label", {}, `GPU ${x.index}`), el("div", { class: "bar" }, bar),
        el("span", {}, `${x.name}: ${gib(x.used_vram_bytes)} of ${gib(x.total_vram_bytes)} VRAM`)));
    }
    const s = m.server;
    const hit = s.prefix_cache_token_hit_rate == null ? "—" : (s.prefix_cache_token_hit_rate * 100).toFixed(0) + " %";
    $("server-counters").textContent =
      `${s.requests_total} requests · ${s.generated_tokens_total} tokens generated · ${s.active_sequences} active, ${s.queue_depth} queued · prompt cache hit ${hit}`;
    $("machine-updated").textContent = new Date().toLocaleTimeString();
  } catch (e) { $("machine-updated").textContent = "failed: " + e.message; }
}

// --- Hardware check ---------------------------------------------------------------------------
async function loadDoctor() {
  try {
    const d = await api("/admin/doctor");
    $("recommendation").textContent = d.summary;
    const tb = $("verdicts"); tb.replaceChildren();
    for (const v of d.configurations) {
      const why = [...v.unmet.map((u) => u.message), ...v.notes.map((n) => "note: " + n)];
      if (v.disk && v.disk.ok !== true) why.push("disk: " + v.disk.message);
      tb.append(el("tr", {}, el("td", {}, v.display_name + (v.configuration.default ? " (default)" : "")),
        el("td", { class: v.fits ? "fits" : "nofit" }, v.fits ? "fits" : "does not fit"),
        el("td", {}, why.join("; ") || "—")));
    }
  } catch (e) { $("recommendation").textContent = "hardware check failed: " + e.message; }
}

// --- Checkpoints and downloads ---------------------------------------------------------------
function downloadCell(repo, configId, dl) {
  const td = el("td", { class: "progress" });
  const start = () => act(api("/admin/downloads", { repo, config_id: configId || undefined }));
  if (!dl) { td.append(el("button", { onclick: start, "data-testid": "download-" + repo }, "Download")); return td; }
  const p = dl.progress;
  if (p && p.bytes_total) {
    const bar = el("div", {}); bar.style.width = (p.bytes_done / p.bytes_total * 100) + "%";
    td.append(el("div", { class: "bar" }, bar));
    td.append(el("div", { class: "muted", "data-testid": "progress-" + repo },
      `${bytes(p.bytes_done)} of ${bytes(p.bytes_total)} · ${bytes(p.speed_bytes_per_s)}/s · ETA ${duration(p.eta_s)} · ${p.phase}${p.file ? " " + p.file : ""}`));
  }
  td.append(el("div", { "data-testid": "dlstate-" + repo }, dl.state));
  if (dl.error) td.append(el("div", { class: "error", "data-testid": "dlerror-" + repo }, dl.error));
  if (dl.state === "running") td.append(el("button", { onclick: () => act(api("/admin/downloads/pause", { repo })), "data-testid": "pause-" + repo }, "Pause"));
  if (dl.state === "paused" || dl.state === "failed") td.append(el("button", { onclick: () => act(api("/admin/downloads/resume", { repo })), "data-testid": "resume-" + repo }, "Resume"));
  return td;
}
async function act(promise) { try { await promise; } catch (e) { alert(e.message); } pollCheckpoints(); }
let running = false;
async function pollCheckpoints() {
  try {
    const c = await api("/admin/checkpoints");
    $("models-dir").textContent = c.models_dir; $("hub").textContent = c.hub;
    const tb = $("ckpts"); tb.replaceChildren();
    running = false;
    for (const r of c.configurations) {
      running ||= r.download && r.download.state === "running";
      tb.append(el("tr", { "data-testid": "ckpt-" + r.id }, el("td", {}, r.display_name, el("div", { class: "muted" }, r.repo)),
        el("td", {}, bytes(r.disk_bytes)), el("td", { "data-testid": "state-" + r.id }, r.state),
        r.state === "installed" ? el("td", {}, "✓ verified") : downloadCell(r.repo, r.id, r.download)));
    }
    const od = $("other-downloads"); od.replaceChildren();
    for (const d of c.other_downloads) {
      running ||= d.state === "running";
      const t = el("table", {}, el("tr", {}, el("td", {}, d.repo), downloadCell(d.repo, d.config_id, d)));
      od.append(t);
    }
    $("other-folders").textContent = c.other_folders.length
      ? "Other folders: " + c.other_folders.map((f) => `${f.name} (${f.state}, ${bytes(f.bytes_on_disk)})`).join(", ") : "";
  } catch (e) { $("models-dir").textContent = "failed: " + e.message; }
}
$("other-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const repo = $("other-repo").value.trim();
  if (repo) act(api("/admin/downloads", { repo }));
});

// --- Idle chats and settings -----------------------------------------------------------------
let offloadDirty = false;
async function pollStatus() {
  try {
    const s = await api("/admin/status");
    const o = s.disk_offload;
    $("offload").checked = o.enabled;
    if (!offloadDirty && document.activeElement !== $("offload-dir")) $("offload-dir").value = o.dir;
    // The prefix cache's disk tier is what is offloaded; without a cache nothing is.
    const pc = s.use && s.use.prefix_cache;
    $("cached-ram").textContent = bytes(pc ? pc.ram_bytes : 0);
    $("offloaded").textContent = bytes(pc ? pc.disk_bytes : 0);
    $("sessions").textContent = (s.sessions || []).length;
  } catch (e) { $("offloaded").textContent = "failed: " + e.message; }
}
$("offload").addEventListener("change", async () => {
  try { await api("/admin/disk-offload", { enabled: $("offload").checked, dir: $("offload-dir").value }); offloadDirty = false; }
  catch (e) { alert(e.message); }
  pollStatus();
});
$("offload-dir").addEventListener("input", () => { offloadDirty = true; });

async function loadSettings() {
  try {
    const s = await api("/admin/settings");
    const f = $("settings-form");
    for (const k of ["models_dir", "port", "vram_budget_gib", "ram_budget_gib"]) f.elements[k].value = s[k] ?? "";
    $("settings-path").textContent = s.path || "(not saved)";
  } catch (_) { /* shown by the other panels */ }
}
$("settings-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const f = ev.target.elements, num = (v) => v === "" ? null : Number(v);
  const patch = { models_dir: f.models_dir.value, port: Number(f.port.value),
    vram_budget_gib: num(f.vram_budget_gib.value), ram_budget_gib: num(f.ram_budget_gib.value) };
  if (f.api_key.value) patch.api_key = f.api_key.value;
  try { await api("/admin/settings", patch); f.api_key.value = ""; } catch (e) { alert(e.message); }
  loadSettings(); pollCheckpoints();
});
$("ui-key").value = key();
$("ui-key").addEventListener("change", () => { localStorage.setItem("capy-ui-key", $("ui-key").value); refreshAll(); });

function refreshAll() { pollState(); pollMachine(); pollStatus(); pollCheckpoints(); loadDoctor(); loadSettings(); }
refreshAll();
setInterval(pollMachine, 1500);
setInterval(pollState, 5000);
setInterval(pollStatus, 2000);
let tick = 0;
setInterval(() => { tick++; if (running || tick % 2 === 0) pollCheckpoints(); }, 1000);
