#!/usr/bin/env bash
# Smoke test of the tray app: starts it under Xvfb in its own D-Bus session (as on a desktop
# without a tray host), checks its in-process server answers /health and serves the dashboard,
# that the dashboard window was opened and logs were written, then quits it with SIGTERM
# (the same path as the tray's Quit) and expects a clean exit.
set -euo pipefail
app=${1:?usage: smoke.sh PATH-TO-capy-flash-app}
for tool in xvfb-run dbus-run-session curl; do
  command -v "$tool" >/dev/null || { echo "smoke.sh: $tool not found (apt-get install xvfb dbus curl)" >&2; exit 1; }
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export CAPY_LOG_DIR="$tmp/logs" CAPY_CONFIG_DIR="$tmp/config" XDG_CONFIG_HOME="$tmp/xdg-config" XDG_DATA_HOME="$tmp/xdg-data"
xvfb-run -a dbus-run-session -- sh -c 'echo $$ > "$0/pid"; exec "$1" --port "$2"' "$tmp" "$app" "$port" \
  >"$tmp/out.log" 2>&1 &
runner=$!
fail() { echo "smoke.sh: $*" >&2; echo "--- app output:" >&2; tail -n 40 "$tmp/out.log" >&2; kill "$runner" 2>/dev/null || true; exit 1; }
for _ in $(seq 1 300); do
  curl -sf "http://127.0.0.1:$port/health" >"$tmp/health.json" 2>/dev/null && break
  kill -0 "$runner" 2>/dev/null || fail "the app exited before its server answered"
  sleep 1
done
grep -q '"status":"ok"' "$tmp/health.json" || fail "no /health answer from the in-process server on port $port within 300 s"
# To a file, then grep: `curl | grep -q` fails under pipefail when grep stops reading early.
curl -sf -o "$tmp/ui.html" "http://127.0.0.1:$port/ui/" || fail "/ui/ did not answer"
grep -q '<title>' "$tmp/ui.html" || fail "/ui/ does not serve the dashboard"
# The dashboard window talks to the server from the app's origin: CORS must allow it.
curl -sf -o /dev/null -H 'Origin: tauri://localhost' -D "$tmp/cors.txt" "http://127.0.0.1:$port/admin/machine" \
  || fail "/admin/machine failed"
grep -qi '^access-control-allow-origin: tauri://localhost' "$tmp/cors.txt" || fail "CORS does not allow the window's origin"
ls "$CAPY_LOG_DIR"/capy-flash-app.log* >/dev/null 2>&1 || fail "no log file in $CAPY_LOG_DIR"
kill -TERM "$(cat "$tmp/pid")"
code=0; wait "$runner" || code=$?
[ "$code" -eq 0 ] || fail "the app exited with $code after SIGTERM (expected 0)"
grep -q 'dashboard window opened' "$CAPY_LOG_DIR"/capy-flash-app.log* || fail "the log does not show the dashboard window opened"
grep -q 'server stopped' "$CAPY_LOG_DIR"/capy-flash-app.log* || fail "the log does not show the server stopped"
grep -q 'server state state="ready"\|server state state=ready' "$CAPY_LOG_DIR"/capy-flash-app.log* || fail "the log does not show the server ready"
grep -q 'bye' "$CAPY_LOG_DIR"/capy-flash-app.log* || fail "the log does not show the app's exit"
echo "smoke.sh: the app served /health and /ui on port $port, opened its window, and quit cleanly"
