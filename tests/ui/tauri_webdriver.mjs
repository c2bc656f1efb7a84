// WebDriver test of the tray app (src-tauri): tauri-driver + WebKitWebDriver start the built app
// under Xvfb in its own D-Bus session; the test drives the dashboard window over the W3C WebDriver
// protocol (plain fetch), checks the window talks to the app's in-process server, clicks through
// the tray menu (over D-Bus, as a desktop's tray host does) and the window, saves a screenshot to
// target/ui-screenshots/, then quits through the tray's Quit and expects exit status 0 and the port
// released.
//
// Run: node --test tests/ui/tauri_webdriver.mjs (scripts/test.sh does, after building the app).
// Env: CAPY_APP (the app binary), TAURI_DRIVER, WEBKIT_WEBDRIVER. Without Xvfb, D-Bus, the drivers
// or the app it skips with the reason, except under CI=true, where it fails.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn, execFile } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import net from "node:net";
import { promisify } from "node:util";
import { fileURLToPath } from "node:url";

const run = promisify(execFile);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
const shots = path.join(root, "target/ui-screenshots");
const app = process.env.CAPY_APP || path.join(root, "src-tauri/target/debug/capy-flash-app");
const tauriDriver = process.env.TAURI_DRIVER || path.join(root, "target/tauri-driver/bin/tauri-driver");
const webkitDriver = process.env.WEBKIT_WEBDRIVER || "/usr/bin/WebKitWebDriver";

function onPath(tool) {
  return (process.env.PATH || "").split(":").some((d) => d && fs.existsSync(path.join(d, tool)));
}
const missing = [];
for (const tool of ["xvfb-run", "dbus-run-session", "gdbus"]) if (!onPath(tool)) missing.push(`${tool} (apt-get install xvfb dbus libglib2.0-bin)`);
if (!fs.existsSync(webkitDriver)) missing.push(`${webkitDriver} (apt-get install webkit2gtk-driver)`);
if (!fs.existsSync(tauriDriver)) missing.push(`${tauriDriver} (cargo install tauri-driver --version 2.1.0 --locked --root target/tauri-driver)`);
if (!fs.existsSync(app)) missing.push(`${app} (cargo build --manifest-path src-tauri/Cargo.toml)`);
const inCI = process.env.CI === "true";
const skip = missing.length && !inCI ? `missing: ${missing.join("; ")}` : false;
if (skip) console.log(`tauri_webdriver: skipped, ${skip}`);

const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "capy-tauri-wd-"));
let driver, driverLog = "", wd, session, port, busEnv;

function freePort() {
  return new Promise((resolve) => { const s = net.createServer(); s.listen(0, "127.0.0.1", () => { const p = s.address().port; s.close(() => resolve(p)); }); });
}
const appLog = () => { try { return fs.readFileSync(path.join(tmp, "app.log"), "utf8").slice(-4000); } catch (_) { return "(no app log)"; } };
async function waitFor(fn, what, ms = 60_000) {
  const t0 = Date.now();
  let last;
  for (;;) {
    try { const v = await fn(); if (v) return v; } catch (e) { last = e; }
    if (Date.now() - t0 > ms) {
      throw new Error(`timed out after ${ms / 1000} s waiting for ${what}${last ? ` (last error: ${last.message})` : ""}\n` +
        `--- drivers:\n${driverLog.slice(-3000)}\n--- app:\n${appLog()}`);
    }
    await sleep(250);
  }
}

// --- W3C WebDriver over fetch ----------------------------------------------------------------
async function call(method, route, body) {
  const r = await fetch(wd + route, {
    method, headers: { "Content-Type": "application/json" }, body: body === undefined ? undefined : JSON.stringify(body),
  });
  const data = await r.json();
  if (!r.ok) throw new Error(`WebDriver ${method} ${route}: HTTP ${r.status} ${JSON.stringify(data.value)}`);
  return data.value;
}
const s = (route) => `/session/${session}${route}`;
async function find(testId) {
  const v = await call("POST", s("/element"), { using: "css selector", value: `[data-testid="${testId}"]` });
  return Object.values(v)[0];
}
const text = async (testId) => call("GET", s(`/element/${await find(testId)}/text`));
const script = (src, args = []) => call("POST", s("/execute/sync"), { script: src, args });

// --- The tray menu over D-Bus (com.canonical.dbusmenu, what a desktop's tray host clicks) -----
const gdbus = (...args) => run("gdbus", args, { env: { ...process.env, ...busEnv } }).then((r) => r.stdout);
async function trayMenu() {
  const names = (await gdbus("call", "--session", "--dest", "org.freedesktop.DBus", "--object-path", "/org/freedesktop/DBus",
    "--method", "org.freedesktop.DBus.ListNames")).match(/:\d+\.\d+/g) || [];
  for (const dest of names) {
    let xml;
    try { xml = await gdbus("introspect", "--session", "--dest", dest, "--object-path", "/org/ayatana/NotificationItem", "--recurse"); } catch (_) { continue; }
    const m = xml.match(/node (\/org\/ayatana\/NotificationItem\/[^ ]+\/Menu) \{/);
    if (m) return { dest, path: m[1] };
  }
  return null;
}
let menu;
async function clickTray(label) {
  menu ||= await waitFor(trayMenu, "the tray menu on the session bus (org.ayatana NotificationItem)");
  const layout = await gdbus("call", "--session", "--dest", menu.dest, "--object-path", menu.path,
    "--method", "com.canonical.dbusmenu.GetLayout", "--", "0", "-1", "[]");
  const items = [...layout.matchAll(/\((\d+), \{[^}]*'label': <'([^']*)'>/g)].map((x) => ({ id: x[1], label: x[2] }));
  const item = items.find((x) => x.label === label);
  assert.ok(item, `no tray menu item ${JSON.stringify(label)}; the menu has ${JSON.stringify(items.map((x) => x.label))}`);
  await gdbus("call", "--session", "--dest", menu.dest, "--object-path", menu.path,
    "--method", "com.canonical.dbusmenu.Event", "--", item.id, "clicked", "<0>", "0");
}

before(async () => {
  if (skip) return;
  if (missing.length) assert.fail(`CI=true and the tray app's WebDriver test cannot run; missing: ${missing.join("; ")}`);
  fs.mkdirSync(shots, { recursive: true });
  port = await freePort();
  const [driverPort, nativePort] = [await freePort(), await freePort()];
  wd = `http://127.0.0.1:${driverPort}`;
  // WebKitWebDriver starts the "browser" binary itself; this wrapper records the app's pid and
  // exit status, which the test cannot see otherwise.
  const wrapper = path.join(tmp, "app.sh");
  fs.writeFileSync(wrapper, `#!/bin/sh\n"$CAPY_APP" "$@" >"$CAPY_WD_TMP/app.log" 2>&1 &\necho $! >"$CAPY_WD_TMP/app.pid"\n` +
    `wait $!\necho $? >"$CAPY_WD_TMP/app.status"\n`, { mode: 0o755 });
  const env = {
    ...process.env, CAPY_APP: app, CAPY_WD_TMP: tmp,
    CAPY_LOG_DIR: path.join(tmp, "logs"), CAPY_CONFIG_DIR: path.join(tmp, "config"), CAPY_MODELS_DIR: path.join(tmp, "models"),
    XDG_CONFIG_HOME: path.join(tmp, "xdg-config"), XDG_DATA_HOME: path.join(tmp, "xdg-data"), XDG_CACHE_HOME: path.join(tmp, "xdg-cache"),
  };
  // One X display and one session bus for the drivers and the app; the shell writes both
  // addresses so the test's own gdbus calls reach the app's bus.
  driver = spawn("xvfb-run", ["-a", "-s", "-screen 0 1280x1024x24", "dbus-run-session", "--", "sh", "-c",
    'printf "%s\\n%s\\n" "$DISPLAY" "$DBUS_SESSION_BUS_ADDRESS" > "$CAPY_WD_TMP/bus"; exec "$0" --port "$1" --native-port "$2" --native-driver "$3"',
    tauriDriver, String(driverPort), String(nativePort), webkitDriver], { env, stdio: ["ignore", "pipe", "pipe"], detached: true });
  driver.stdout.on("data", (d) => { driverLog += d; });
  driver.stderr.on("data", (d) => { driverLog += d; });
  const [display, bus] = await waitFor(() => {
    const l = fs.readFileSync(path.join(tmp, "bus"), "utf8").split("\n");
    return l[1] ? l : null;
  }, "Xvfb and the D-Bus session");
  busEnv = { DISPLAY: display, DBUS_SESSION_BUS_ADDRESS: bus };
  await waitFor(async () => (await fetch(wd + "/status")).ok, "tauri-driver");
  const created = await call("POST", "/session", {
    capabilities: { alwaysMatch: { "tauri:options": { application: wrapper, args: ["--port", String(port), "--model", "demo"] } } },
  });
  session = created.sessionId;
});

after(async () => {
  const pid = Number(fs.existsSync(path.join(tmp, "app.pid")) && fs.readFileSync(path.join(tmp, "app.pid"), "utf8"));
  if (pid) try { process.kill(pid, "SIGKILL"); } catch (_) { /* exited, as it should */ }
  if (driver && driver.exitCode === null) try { process.kill(-driver.pid, "SIGTERM"); } catch (_) { /* gone */ }
  // WebKit can D-Bus-activate xdg-document-portal. With XDG_RUNTIME_DIR unset, the portal
  // mounts its FUSE file system under XDG_CACHE_HOME/doc, inside tmp. The portal unmounts it
  // as it exits, which can be after the bus is gone. Removing tmp before then fails with
  // EISDIR. So wait for the drivers to exit and the mount to go, and unmount it if it stays.
  for (let i = 0; i < 50 && driver && driver.exitCode === null && driver.signalCode === null; i++) await sleep(100);
  for (let i = 0; i < 30 && mountsUnder(tmp).length; i++) await sleep(100);
  const fusermount = onPath("fusermount3") ? "fusermount3" : "fusermount";
  for (const mnt of mountsUnder(tmp)) {
    try { await run(fusermount, ["-uz", mnt]); } catch (e) {
      if (mountsUnder(tmp).includes(mnt)) console.error(`could not unmount ${mnt}: ${e.message}`);
    }
  }
  fs.rmSync(tmp, { recursive: true, force: true, maxRetries: 5, retryDelay: 200 });
});

// Mount points at or below dir, deepest first, from /proc/self/mounts (octal escapes decoded).
function mountsUnder(dir) {
  let table = "";
  try { table = fs.readFileSync("/proc/self/mounts", "utf8"); } catch (_) { return []; }
  return table.split("\n").map((l) => (l.split(" ")[1] || "").replace(/\\([0-7]{3})/g, (_, o) => String.fromCharCode(parseInt(o, 8))))
    .filter((m) => m === dir || m.startsWith(dir + path.sep))
    .sort((a, b) => b.length - a.length);
}

test("the app's window shows its in-process server, round-trips through it, and quits cleanly", { skip }, async () => {
  // The window is the app's own page (not the server's /ui) and talks to the app's server.
  const where = await script("return [window.location.protocol, window.CAPY_ENDPOINT];");
  assert.equal(where[0], "tauri:", `the window should load the app's bundled dashboard (tauri://localhost), not a server page: ${where}`);
  assert.equal(where[1], `http://127.0.0.1:${port}`);
  await waitFor(async () => (await text("server-state")) === "ready", "the window's dashboard to show the server ready", 300_000);
  assert.equal(await text("endpoint"), `http://127.0.0.1:${port}`);
  assert.match(await text("model"), /serving demo/);
  const health = await (await fetch(`http://127.0.0.1:${port}/health`)).json();
  assert.equal(health.status, "ok");
  await waitFor(async () => /requests/.test(await text("server-counters")), "the machine figures from the server");

  // The window → server: the disk-offload toggle, clicked in the window, changes the server.
  const dir = path.join(tmp, "offload");
  await call("POST", s(`/element/${await find("offload-dir")}/clear`), {});
  await call("POST", s(`/element/${await find("offload-dir")}/value`), { text: dir });
  await call("POST", s(`/element/${await find("offload-toggle")}/click`), {});
  await waitFor(async () => {
    const st = await (await fetch(`http://127.0.0.1:${port}/admin/status`)).json();
    return st.disk_offload.enabled && st.disk_offload.dir === dir;
  }, "the server's disk offload to turn on with the window's folder");
  const saved = JSON.parse(fs.readFileSync(path.join(tmp, "config/settings.json"), "utf8"));
  assert.equal(saved.disk_offload, true);
  await sleep(2500); // the next status poll re-reads the server's state
  assert.equal(await call("GET", s(`/element/${await find("offload-toggle")}/selected`)), true);

  // The tray → server → window: Stop server, the dashboard sees it gone; Start server, back.
  await clickTray("Stop server");
  await waitFor(async () => (await text("server-state")) === "unreachable", "the window to see the server stopped");
  await assert.rejects(fetch(`http://127.0.0.1:${port}/health`), "the port should be closed after Stop server");
  await clickTray("Start server");
  await waitFor(async () => (await text("server-state")) === "ready", "the window to see the server started again", 300_000);

  await script("window.scrollTo(0, 0);");
  const png = Buffer.from(await call("GET", s("/screenshot")), "base64");
  assert.equal(png.subarray(1, 4).toString(), "PNG");
  fs.writeFileSync(path.join(shots, "tauri-app-window.png"), png);

  // Quit from the tray: the app stops its server and exits with 0, releasing the port.
  await clickTray("Quit");
  const status = await waitFor(() => {
    const f = path.join(tmp, "app.status");
    return fs.existsSync(f) && fs.readFileSync(f, "utf8").trim();
  }, "the app to exit after Quit", 60_000);
  assert.equal(status, "0", `the app exited with status ${status} after Quit (expected 0)\n${appLog()}`);
  const log = fs.readdirSync(path.join(tmp, "logs")).map((f) => fs.readFileSync(path.join(tmp, "logs", f), "utf8")).join("");
  assert.match(log, /quitting: stopping the server/);
  assert.match(log, /server stopped/);
  await new Promise((resolve, reject) => {
    const srv = net.createServer().once("error", (e) => reject(new Error(`port ${port} still in use after Quit: ${e.message}`)));
    srv.listen(port, "127.0.0.1", () => srv.close(resolve));
  });
  try { await call("DELETE", s("")); } catch (_) { /* the browser (the app) is gone already */ }
});
