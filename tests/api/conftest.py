"""Starts `capy-flash serve --model demo` on a free port (or uses CAPY_TEST_BASE_URL)."""

import os
import socket
import subprocess
import time

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def base_url():
    if os.environ.get("CAPY_TEST_BASE_URL"):
        yield os.environ["CAPY_TEST_BASE_URL"].rstrip("/")
        return
    binary = os.environ.get("CAPY_BIN", "target/debug/capy-flash")
    if not os.path.exists(binary):
        pytest.fail(f"server binary {binary} not found: build it (cargo build -p capy-flash) or set CAPY_BIN")
    port = _free_port()
    proc = subprocess.Popen([binary, "serve", "--model", "demo", "--backend", os.environ.get("CAPY_TEST_BACKEND", "cpu"),
                             "--port", str(port), "--context", "2048"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300  # the first run generates the demo model
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited: {proc.stdout.read().decode(errors='replace')}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("the server did not become healthy in 300 s")
    yield url
    proc.terminate()
    proc.wait(timeout=10)
