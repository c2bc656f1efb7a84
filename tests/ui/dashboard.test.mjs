// Browser tests of the dashboard: headless Chromium (Debian's `chromium`, driven by
// playwright-core) against a real `capy-flash serve --model demo`, with downloads from a local
// hub that emulates Hugging Face. Screenshots go to target/ui-screenshots/.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import net from "node:net";
import { fileURLToPath } from "node:url";
import { chromium } from "playwright-core";
import { startHub, content } from "./hub.mjs";

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
const bin = process.env.CAPY_BIN || path.join(root, "target/debug/capy-flash");
const shots = path.join(root, "target/ui-screenshots");
const browserPath = process.env.CHROMIUM || ["/usr/bin/chromium", "/usr/bin/chromium-browser"].find((p) => fs.existsSync(p));

const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "capy-ui-"));
const modelsDir = path.join(tmp, "models");
const configDir = path.join(tmp, "config");
const big = content(3_000_000, 7);
const repos = {
  "capy-test/tiny-ckpt": [
    { path: "config.json", data: Buffer.from('{"model_type": "qwen3_5_text"}'), lfs: false },
    { path: "model.safetensors", data: big, lfs: true },
  ],
  "capy-test/bad-ckpt": [{ path: "model.safetensors", data: content(200_000, 9), lfs: true, wrongChecksum: true }],
};

let hub, server, browser, page, origin, port, serverLog = "";

function freePort() {
  return new Promise((resolve) => { const s = net.createServer(); s.listen(0, "127.0.0.1", () => { const p = s.address().port; s.close(() => resolve(p)); }); });
}
async function waitFor(fn, what, ms = 60_000) {
  const t0 = Date.now();
  for (;;) {
    try { const v = await fn(); if (v) return v; } catch (_) { /* not yet */ }
    if (Date.now() - t0 > ms) throw new Error(`timed out waiting for ${what}\nserver log:\n${serverLog.slice(-3000)}`);
    await new Promise((r) => setTimeout(r, 200));
  }
}
const text = (id) => page.getByTestId(id).innerText();

async function startServer() {
  server = spawn(bin, ["serve", "--model", "demo", "--port", String(port)], {
    env: { ...process.env, HF_ENDPOINT: hub.url, CAPY_MODELS_DIR: modelsDir, CAPY_CONFIG_DIR: configDir },
    stdio: ["ignore", "pipe", "pipe"],
  });
  server.stdout.on("data", (d) => { serverLog += d; });
  server.stderr.on("data", (d) => { serverLog += d; });
  await waitFor(async () => (await fetch(origin + "/health")).ok, "the server", 300_000);
}
async function stopServer() {
  const exited = new Promise((resolve) => server.once("exit", (code, signal) => resolve({ code, signal })));
  server.kill("SIGINT");
  return exited;
}

before(async () => {
  assert.ok(browserPath, "chromium not found: apt-get install chromium (or set CHROMIUM)");
  assert.ok(fs.existsSync(bin), `${bin} not found: cargo build -p capy-flash (or set CAPY_BIN)`);
  fs.mkdirSync(shots, { recursive: true });
  hub = await startHub(repos);
  port = await freePort();
  origin = `http://127.0.0.1:${port}`;
  await startServer();
  browser = await chromium.launch({ executablePath: browserPath, args: ["--no-sandbox", "--disable-dev-shm-usage"] });
  const context = await browser.newContext({ viewport: { width: 1280, height: 1400 } });
  await context.grantPermissions(["clipboard-read", "clipboard-write"], { origin });
  page = await context.newPage();
  await page.goto(origin + "/ui");
  await waitFor(async () => (await text("server-state")) === "ready", "the dashboard to see the server");
});

after(async () => {
  await browser?.close();
  if (server && server.exitCode === null) server.kill("SIGINT");
  hub?.server.close();
  fs.rmSync(tmp, { recursive: true, force: true });
});

test("shows the endpoint and copies the Claude Code snippet", async () => {
  assert.equal(await text("endpoint"), origin);
  await page.getByTestId("copy-claude").click();
  await waitFor(async () => (await text("copied")).includes("Copied"), "the copy confirmation");
  const clip = await page.evaluate(() => navigator.clipboard.readText());
  assert.match(clip, new RegExp(`^export ANTHROPIC_BASE_URL=${origin.replace(/[.]/g, "\\.")}$`, "m"));
  await page.getByRole("button", { name: "Codex" }).click();
  assert.match(await text("snippet-codex"), /wire_api = "responses"/);
  assert.match(await text("snippet-codex"), new RegExp(`base_url = "${origin}/v1"`));
});

test("machine figures are live and follow the server's work", async () => {
  const ram = await text("ram");
  assert.match(ram, /\d+\.\d GiB used of \d+\.\d GiB/);
  const first = await text("machine-updated");
  await waitFor(async () => (await text("machine-updated")) !== first, "a second machine poll");
  const r = await fetch(origin + "/v1/chat/completions", {
    method: "POST", headers: { "content-type": "application/json" },
    body: JSON.stringify({ model: "demo", messages: [{ role: "user", content: "hi" }], max_tokens: 4 }),
  });
  assert.equal(r.status, 200, await r.text());
  await waitFor(async () => /^[1-9]\d* requests · [1-9]\d* tokens generated/.test(await text("server-counters")),
    "the request counters to move");
  const doctor = await text("verdicts");
  assert.match(doctor, /Qwen3\.8-Flash-Next NVFP4/);
  await page.screenshot({ path: path.join(shots, "dashboard.png"), fullPage: true });
});

test("toggles disk offload and persists it", async () => {
  const dir = path.join(tmp, "offload");
  await page.getByTestId("offload-dir").fill(dir);
  await page.getByTestId("offload-toggle").check();
  await waitFor(async () => (await (await fetch(origin + "/admin/status")).json()).disk_offload.enabled, "offload on");
  const saved = JSON.parse(fs.readFileSync(path.join(configDir, "settings.json"), "utf8"));
  assert.equal(saved.disk_offload, true);
  assert.equal(saved.disk_offload_dir, dir);
  assert.ok(fs.statSync(dir).isDirectory());
  // The figures shown are the prefix cache's RAM and disk use, as the server reports them.
  const fmt = (b) => (b >= 1e9 ? (b / 1e9).toFixed(2) + " GB" : b >= 1e6 ? (b / 1e6).toFixed(1) + " MB" : b >= 1e3 ? (b / 1e3).toFixed(1) + " kB" : b + " B");
  await waitFor(async () => {
    const st = await (await fetch(origin + "/admin/status")).json();
    const pc = st.use.prefix_cache;
    return (await text("offloaded")) === fmt(pc.disk_bytes) && (await text("cached-ram")) === fmt(pc.ram_bytes);
  }, "the RAM and disk bytes of idle chats as the server reports them");
  await page.getByTestId("offload-toggle").uncheck();
  await waitFor(async () => !(await (await fetch(origin + "/admin/status")).json()).disk_offload.enabled, "offload off");
});

test("downloads from the hub: interrupted, resumed, verified", async () => {
  const repo = "capy-test/tiny-ckpt";
  hub.state.cutNext[`${repo}/model.safetensors`] = 1_000_000;
  await page.getByTestId("repo-input").fill(repo);
  await page.getByTestId("repo-download").click();
  await waitFor(async () => (await text(`dlstate-${repo}`)) === "failed", "the cut transfer to fail");
  const part = path.join(modelsDir, "tiny-ckpt", "model.safetensors.part");
  const kept = fs.statSync(part).size;
  assert.ok(kept > 0 && kept <= 1_000_000, `kept ${kept}`);
  assert.ok(!fs.existsSync(path.join(modelsDir, "tiny-ckpt", "model.safetensors")));
  await page.screenshot({ path: path.join(shots, "download-interrupted.png"), fullPage: true });
  hub.state.chunkDelayMs = 30;
  await page.getByTestId(`resume-${repo}`).click();
  await waitFor(async () => /ETA/.test(await text(`progress-${repo}`)), "progress with speed and ETA");
  await page.screenshot({ path: path.join(shots, "download-progress.png"), fullPage: true });
  hub.state.chunkDelayMs = 2;
  await waitFor(async () => (await text(`dlstate-${repo}`)) === "done", "the resumed download", 120_000);
  assert.deepEqual(fs.readFileSync(path.join(modelsDir, "tiny-ckpt", "model.safetensors")), big);
  assert.ok(!fs.existsSync(part));
  const resumed = hub.state.ranges.filter((r) => r.path === "model.safetensors").map((r) => r.range);
  assert.deepEqual(resumed, [null, `bytes=${kept}-`]);
  await waitFor(async () => /tiny-ckpt \(installed/.test(await page.locator("#other-folders").innerText()), "the folder listed as installed");
});

test("a checksum mismatch is refused", async () => {
  const repo = "capy-test/bad-ckpt";
  await page.getByTestId("repo-input").fill(repo);
  await page.getByTestId("repo-download").click();
  await waitFor(async () => (await text(`dlstate-${repo}`)) === "failed", "the mismatch");
  assert.match(await text(`dlerror-${repo}`), /SHA-256 is [0-9a-f]{64}, the hub says [0-9a-f]{64}/);
  const dir = path.join(modelsDir, "bad-ckpt");
  assert.deepEqual(fs.readdirSync(dir), [], "neither the file nor its .part remain");
  await page.screenshot({ path: path.join(shots, "download-checksum-refused.png"), fullPage: true });
});

test("a folder added by hand shows up", async () => {
  fs.mkdirSync(path.join(modelsDir, "by-hand"));
  fs.writeFileSync(path.join(modelsDir, "by-hand", "config.json"), "{}");
  await waitFor(async () => /by-hand \(installed/.test(await page.locator("#other-folders").innerText()), "the new folder");
});

// Last: a restarted server is a new process (downloads in flight are not carried over).
test("follows the server stopping and starting again", async () => {
  const { code } = await stopServer();
  assert.equal(code, 0, `the server exits cleanly on SIGINT\n${serverLog.slice(-2000)}`);
  await waitFor(async () => (await text("server-state")) === "unreachable", "the dashboard to see the server stopped");
  await page.screenshot({ path: path.join(shots, "server-stopped.png"), fullPage: true });
  await startServer();
  await waitFor(async () => (await text("server-state")) === "ready", "the dashboard to see the server back");
  assert.match(await text("model"), /serving demo/);
});
