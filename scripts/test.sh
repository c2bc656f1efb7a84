#!/usr/bin/env bash
# Runs every test of Capy Flash on a fresh Debian/Ubuntu machine (no GPU needed):
# installs what the tests need (Debian packages, a Python venv with the official OpenAI and
# Anthropic SDKs and NVIDIA's NVRTC wheel), then runs the Rust tests, lints, and the API tests
# against a real server. GPU execution tests skip with a printed reason where no driver exists.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

say() { printf '\n== %s\n' "$*"; }

if ! command -v cargo >/dev/null; then
  echo "cargo not found: install a Rust toolchain (https://rustup.rs) and run again" >&2
  exit 1
fi

say "system packages"
need_apt=()
command -v cc >/dev/null || need_apt+=(build-essential)
# The CUDA kernel emulation tests build C++20 with AddressSanitizer (libasan comes with g++).
command -v c++ >/dev/null || need_apt+=(g++)
command -v pkg-config >/dev/null || need_apt+=(pkg-config)
python3 -m venv --help >/dev/null 2>&1 || need_apt+=(python3-venv)
command -v python3 >/dev/null || need_apt+=(python3 python3-venv)
# The dashboard's browser tests (Node, Debian's Chromium) and the tray app (WebKitGTK, a tray
# library, Xvfb + D-Bus to start it headless, WebKitWebDriver and gdbus for its WebDriver test).
command -v node >/dev/null || need_apt+=(nodejs)
command -v npm >/dev/null || need_apt+=(npm)
command -v curl >/dev/null || need_apt+=(curl)
[ -x /usr/bin/chromium ] || [ -n "${CHROMIUM:-}" ] || need_apt+=(chromium)
for p in libwebkit2gtk-4.1-dev libayatana-appindicator3-dev librsvg2-dev xvfb xauth dbus webkit2gtk-driver libglib2.0-bin; do
  dpkg -s "$p" >/dev/null 2>&1 || need_apt+=("$p")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
fi

say "python test environment"
venv="$root/target/test-venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q --disable-pip-version-check -r tests/requirements.txt
# NVRTC from NVIDIA's wheel lets CI compile every CUDA kernel without a GPU or toolkit.
nvrtc=$(find "$venv" -name 'libnvrtc.so*' -not -name '*builtins*' 2>/dev/null | sort | head -n 1 || true)
if [ -n "$nvrtc" ]; then
  export CAPY_NVRTC_LIB="$nvrtc"
  echo "NVRTC for kernel compile tests: $nvrtc"
fi
export CAPY_TEST_PYTHON="$venv/bin/python"
# One clean build: incremental caches would only add ~4 GB of disk that is never reused.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
free_kib=$(df -Pk "$root" | awk 'NR==2 {print $4}')
echo "free disk at $root: $((free_kib / 1024 / 1024)) GiB (a clean run of this script needs about 6 GiB)"
export CAPY_CACHE_DIR="$root/target/capy-cache"

say "format"
cargo fmt --all -- --check

say "rust tests"
cargo test --workspace --all-targets

say "clippy"
cargo clippy --workspace --all-targets -- -D warnings

if [ -d tests/api ]; then
  say "API tests with the official openai and anthropic SDKs"
  cargo build -p capy-flash
  CAPY_BIN="$root/target/debug/capy-flash" "$venv/bin/python" -m pytest -q tests/api
fi
say "dashboard browser tests (Chromium + playwright-core against capy-flash serve --model demo)"
browser=${CHROMIUM:-}
if [ -z "$browser" ]; then
  for b in /usr/bin/chromium /usr/bin/chromium-browser; do
    # Ubuntu's chromium-browser is a snap launcher that does not run here: try each one.
    if [ -x "$b" ] && "$b" --headless --no-sandbox --version >/dev/null 2>&1; then browser=$b; break; fi
  done
fi
if [ -z "$browser" ]; then
  echo "no working Chromium for the dashboard tests: on Debian apt-get install chromium;" >&2
  echo "on Ubuntu (where chromium is a snap) install a Chromium build and set CHROMIUM=/path/to/it" >&2
  exit 1
fi
echo "browser: $browser ($("$browser" --headless --no-sandbox --version 2>/dev/null))"
npm ci --no-audit --no-fund --loglevel=error
cargo build -p capy-flash
CAPY_BIN="$root/target/debug/capy-flash" CHROMIUM="$browser" node --test tests/ui/
echo "screenshots: $root/target/ui-screenshots/"

say "tray app (src-tauri, its own workspace): format, build, clippy, smoke run under Xvfb + D-Bus"
cargo fmt --manifest-path src-tauri/Cargo.toml -- --check
cargo build --manifest-path src-tauri/Cargo.toml --locked
cargo clippy --manifest-path src-tauri/Cargo.toml --locked --all-targets -- -D warnings
bash src-tauri/tests/smoke.sh "$root/src-tauri/target/debug/capy-flash-app"

say "tray app WebDriver test (tauri-driver + WebKitWebDriver: window, in-process server, tray Quit)"
# Pinned; installed once under target/ (a second run finds it and skips the build).
cargo install tauri-driver --version 2.1.0 --locked --root "$root/target/tauri-driver" --quiet
# CI=true: here every tool is installed above, so the test must run, never skip.
CI=true CAPY_APP="$root/src-tauri/target/debug/capy-flash-app" TAURI_DRIVER="$root/target/tauri-driver/bin/tauri-driver" \
  node --test tests/ui/tauri_webdriver.mjs
echo "screenshot: $root/target/ui-screenshots/tauri-app-window.png"

say "all tests passed"
