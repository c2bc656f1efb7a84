#!/usr/bin/env bash
# Sets up and runs Capy Flash on a fresh Debian/Ubuntu machine: build tools and Rust if
# missing, a release build, then the server. Uses the checkpoint folder in $CAPY_MODEL when set
# (or the first argument), otherwise the built-in demo model. Extra arguments go to `serve`.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
need_apt=()
command -v cc >/dev/null || need_apt+=(build-essential)
command -v pkg-config >/dev/null || need_apt+=(pkg-config)
command -v curl >/dev/null || need_apt+=(curl ca-certificates)
if [ ${#need_apt[@]} -gt 0 ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
fi
if ! command -v cargo >/dev/null; then
  if [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
  else
    echo "Installing Rust (rustup) …"
    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
    export PATH="$HOME/.cargo/bin:$PATH"
  fi
fi

cargo build --release -p capy-flash

model="${CAPY_MODEL:-}"
if [ $# -gt 0 ] && [ -d "$1" ]; then model="$1"; shift; fi
if [ -z "$model" ]; then
  echo "No checkpoint given (set CAPY_MODEL or pass a model folder): serving the built-in demo model."
  model=demo
fi
exec ./target/release/capy-flash serve --model "$model" "$@"
