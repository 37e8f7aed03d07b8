"""Faults of tensor-parallel ranks (target_gpu.tensor_parallel): nothing hangs, the failure
names the rank, and no process is left behind.

- A worker killed mid-generation: the next step raises TPWorkerError naming the rank and the
  signal, every later step too; the requests abort and give their KV blocks back.
- A worker that hangs (stopped): the step fails after --worker-timeout, naming it.
- A worker that dies while the engine is idle: the heartbeat notices, the server's engine
  loop dies (on_death: runtime.serve exits 1) and /health answers 503; `python -m
  runtime.serve` itself exits 1 with the rank in its error.
- Rank 0's process ended by SIGTERM or SIGKILL, or an LLM dropped without close(): its workers
  are gone within seconds.
On a tiny random Llama at TP=2 (one worker process)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import psutil
import pytest

from runtime.async_engine import AsyncEngine
from runtime.serve import build_app
from target_gpu.tensor_parallel import TPWorkerError
from tests.helpers import free_port, greedy, new_engine, save_tiny_model
from tests.server.test_server import serving


@pytest.fixture(scope="module")
def tiny_dir(engine_f32, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tp-faults")
    save_tiny_model("llama3", directory, engine_f32.tokenizer)
    return str(directory)


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    """The pids still running after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def start_requests(engine, n: int = 3) -> list[str]:
    ids = [engine.add_request(f"Count to {i + 5}:", greedy(64)) for i in range(n)]
    for _ in range(3):
        engine.step()
    return ids


def test_killed_worker_fails_the_step_naming_it(tiny_dir):
    engine = new_engine(model=tiny_dir, tensor_parallel_size=2)
    worker = engine.runner.workers[1]
    try:
        ids = start_requests(engine)
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(TPWorkerError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
            engine.step()
        assert time.monotonic() - start < 5
        with pytest.raises(TPWorkerError, match="rank 1"):  # the engine stays failed
            engine.step()
        for rid in ids:
            engine.abort(rid)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        start = time.monotonic()
        engine.close()
        assert time.monotonic() - start < 5
    assert not worker.is_alive()


def test_hung_worker_fails_the_step_after_the_timeout(tiny_dir):
    engine = new_engine(model=tiny_dir, tensor_parallel_size=2, worker_timeout=2)
    worker = engine.runner.workers[1]
    try:
        start_requests(engine)
        os.kill(worker.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(TPWorkerError, match=r"rank 1 \(stopped\) did not answer within 2 s"):
            engine.step()
        assert 1.5 < time.monotonic() - start < 10
    finally:
        engine.close()  # kills what does not stop
    assert wait_gone([worker.pid]) == []


def test_worker_death_while_idle_kills_the_server_loop_and_health(tiny_dir):
    engine = new_engine(model=tiny_dir, tensor_parallel_size=2)
    worker = engine.runner.workers[1]
    deaths = []
    async_engine = AsyncEngine(engine, on_death=deaths.append)
    try:
        with serving(build_app(async_engine, "tiny")) as base_url:
            ok = httpx.post(f"{base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
            assert ok.status_code == 200 and httpx.get(f"{base_url}/health").status_code == 200
            os.kill(worker.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while not deaths and time.monotonic() < deadline:
                time.sleep(0.05)
            assert deaths and "rank 1" in str(deaths[0]) and "SIGKILL" in str(deaths[0])
            assert httpx.get(f"{base_url}/health").status_code == 503
            failed = httpx.post(f"{base_url}/v1/completions", json={"prompt": "Hi"}, timeout=30)
            assert failed.status_code == 503 and "rank 1" in failed.json()["error"]["message"]
    finally:
        async_engine.shutdown()
    assert not worker.is_alive()


def test_server_exits_1_naming_the_rank(tiny_dir):
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "runtime.serve", "--model", tiny_dir, "--dtype", "float32",
                               "--device", "cpu", "--port", str(port), "--tensor-parallel-size", "2",
                               "--kv-cache-memory", "16MiB"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while server.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        workers = [p for p in psutil.Process(server.pid).children() if "spawn_main" in " ".join(p.cmdline())]
        assert len(workers) == 1
        workers[0].kill()
        output, _ = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    assert server.returncode == 1, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors and "rank 1" in errors[-1] and "SIGKILL" in errors[-1], output[-3000:]


RANK0 = textwrap.dedent("""
    import sys, time
    from runtime.llm import LLM
    if __name__ == "__main__":
        llm = LLM(model=sys.argv[1], dtype="float32", device="cpu", tensor_parallel_size=2, enforce_eager=True,
                  kv_cache_memory="16MiB")
        llm.generate(["Hello"], use_tqdm=False)
        print("workers", *(w.pid for w in llm.engine.runner.workers.values()), flush=True)
        if sys.argv[2] == "gc":
            del llm
            import gc; gc.collect()
            print("collected", flush=True)
        time.sleep(600)
""")


@pytest.mark.parametrize("ending", ["SIGTERM", "SIGKILL", "gc"])
def test_no_orphan_workers(tiny_dir, tmp_path, ending):
    script = tmp_path / "rank0.py"
    script.write_text(RANK0)
    rank0 = subprocess.Popen([sys.executable, str(script), tiny_dir, ending], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, cwd=os.getcwd(),
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        lines = iter(rank0.stdout.readline, "")
        pids = [int(p) for p in next(line for line in lines if line.startswith("workers")).split()[1:]]
        assert len(pids) == 1 and psutil.pid_exists(pids[0])
        if ending == "gc":
            assert next(line for line in lines if line.startswith("collected"))
        else:
            rank0.send_signal(getattr(signal, ending))
        assert wait_gone(pids) == []
    finally:
        rank0.kill()
        rank0.wait()
