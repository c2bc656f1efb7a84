#!/usr/bin/env bash
# SDK tests of the HTTP API: creates a venv, installs tests/api/requirements.txt, runs pytest.
# Builds nothing: CAPY_BIN must name a built capy-flash (e.g. target/debug/capy-flash), or
# CAPY_TEST_BASE_URL a running server.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${CAPY_API_VENV:-$here/../../.venv-api}"
if [ -z "${CAPY_TEST_BASE_URL:-}" ]; then
  : "${CAPY_BIN:?set CAPY_BIN to the capy-flash binary (cargo build -p capy-flash)}"
  CAPY_BIN="$(realpath "$CAPY_BIN")"
  export CAPY_BIN
fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q -r "$here/requirements.txt"
exec "$venv/bin/python" -m pytest -q "$here" "$@"
