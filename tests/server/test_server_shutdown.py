"""`python -m runtime.serve` as a process: SIGTERM drains in-flight requests within
--shutdown-timeout and exits 0; the API key comes from the environment."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.helpers import free_port

pytest.importorskip("uvicorn")

REPO = Path(__file__).resolve().parents[2]
KEY = {"Authorization": "Bearer sekret"}


@contextmanager
def server_process(*flags: str):
    port = free_port()
    env = {**os.environ, "HETEROSPEC_API_KEY": "sekret"}
    proc = subprocess.Popen([sys.executable, "-m", "runtime.serve", "--port", str(port), "--dtype", "float32",
                             "--kv-cache-memory", "64MiB", "--log-level", "warning", "--enforce-eager", *flags],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        yield proc, base_url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def stream_events(base_url: str, body: dict, on_first_event) -> list:
    """The SSE payloads of a streamed completion; on_first_event() runs after the first."""
    events = []
    with httpx.stream("POST", f"{base_url}/v1/completions", json={**body, "stream": True}, headers=KEY,
                      timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                if len(events) == 1:
                    on_first_event()
    return events


def test_sigterm_finishes_in_flight_requests_then_exits_0():
    with server_process("--shutdown-timeout", "60") as (proc, base_url):
        assert httpx.get(f"{base_url}/v1/models").status_code == 401  # HETEROSPEC_API_KEY is the key
        assert httpx.get(f"{base_url}/v1/models", headers=KEY).status_code == 200
        body = {"prompt": "Count: one two three", "max_tokens": 24, "ignore_eos": True, "temperature": 0}
        events = stream_events(base_url, body, lambda: proc.send_signal(signal.SIGTERM))
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # it ran to the end
        assert proc.wait(60) == 0
        with pytest.raises(httpx.TransportError):  # nothing listens any more
            httpx.get(f"{base_url}/health", timeout=2)


def test_sigterm_aborts_what_outlives_the_timeout_and_exits_0():
    with server_process("--shutdown-timeout", "1") as (proc, base_url):
        body = {"prompt": "Count:", "max_tokens": 1200, "ignore_eos": True}
        start = time.monotonic()
        try:
            events = stream_events(base_url, body, lambda: proc.send_signal(signal.SIGTERM))
        except httpx.TransportError:  # the server cut the connection
            events = []
        assert proc.wait(60) == 0
        assert time.monotonic() - start < 45, "the drain did not stop at the timeout"
        assert not events or all('"finish_reason":"length"' not in e for e in events)


def test_a_model_that_cannot_load_exits_2_with_one_line():
    """The engine is built on the engine loop's thread; its error still reaches the user as before."""
    proc = subprocess.run([sys.executable, "-m", "runtime.serve", "--port", str(free_port()), "--model",
                           str(REPO / "no-such-model")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no-such-model" in errors[0], proc.stderr
