"""The server under load: 64 concurrent streaming clients over real HTTP on 127.0.0.1, a
random third of them hanging up mid-stream. Every other client gets exactly the text its
request gives when run alone (greedy, float32), and afterwards no sequence is left and
every KV block is free. Each of 16 prompts is asked by four clients, which also makes
the prefix cache share blocks between running requests."""
from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

pytest.importorskip("uvicorn")

from runtime.config import EngineConfig  # noqa: E402
from runtime.engine import LLMEngine  # noqa: E402
from runtime.sampling_params import SamplingParams  # noqa: E402
from tests.server.test_server import metric, run_directly, serving_engine, wait_idle  # noqa: E402

MODEL = "smollm2-135m"
NUM_CLIENTS = 64
MAX_TOKENS = 10


def distinct_prompts() -> list[str]:
    subjects = ["rivers", "CPUs", "bread", "chess", "rain", "owls", "trains", "glass"]
    return [f"Write one sentence about {subjects[i % 8]} and the number {i}." for i in range(16)]


def prompts() -> list[str]:
    """64 prompts, each of 16 asked four times (so 16 runs alone are the references)."""
    return [distinct_prompts()[i % 16] for i in range(NUM_CLIENTS)]


async def stream_text(client: httpx.AsyncClient, base_url: str, prompt: str, hang_up_after: int | None) -> str | None:
    """The streamed text of one completion; None when this client hangs up after
    `hang_up_after` chunks (closing the connection mid-stream)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}
    text, chunks = "", 0
    async with client.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            text += event["choices"][0]["text"]
            chunks += 1
            if hang_up_after is not None and chunks >= hang_up_after:
                return None  # leaving the block closes the response: the server sees a disconnect
    return text


async def run_clients(base_url: str, hang_ups: dict[int, int]) -> list[str | None]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        return await asyncio.gather(*(stream_text(client, base_url, p, hang_ups.get(i))
                                      for i, p in enumerate(prompts())))


def test_64_streaming_clients_a_third_hanging_up():
    engine = LLMEngine(EngineConfig(enforce_eager=True, dtype="float32", device="cpu", kv_cache_memory="256MiB", max_num_seqs=32,
                                    speculator="lookahead"))
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    alone = [run_directly(engine, p, greedy) for p in distinct_prompts()] * (NUM_CLIENTS // 16)
    rng = random.Random(0)
    hang_ups = {i: rng.randint(1, 3) for i in rng.sample(range(NUM_CLIENTS), NUM_CLIENTS // 3)}
    with serving_engine(engine) as base_url:
        texts = asyncio.run(run_clients(base_url, hang_ups))
        for i, (text, reference) in enumerate(zip(texts, alone)):
            if i in hang_ups and text is None:
                continue  # hung up (one whose answer was shorter than its hang-up point read it all)
            assert i in hang_ups or text is not None
            assert text == reference, f"client {i}: {text!r} != alone {reference!r}"
        assert sum(text is None for text in texts) >= NUM_CLIENTS // 4
        wait_idle(engine)
        assert not engine.scheduler.running and not engine.scheduler.waiting
        aborted = metric(base_url, 'heterospec_requests_total{finish_reason="abort"}')
        finished = sum(metric(base_url, f'heterospec_requests_total{{finish_reason="{reason}"}}')
                       for reason in ("stop", "length"))
        assert finished >= NUM_CLIENTS - len(hang_ups) and aborted + finished == NUM_CLIENTS, (aborted, finished)
        assert aborted >= 1, "no client's hang-up reached the server before its request finished"
