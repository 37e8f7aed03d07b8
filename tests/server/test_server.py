"""The OpenAI-compatible server end to end: real HTTP on 127.0.0.1, the real `openai` client.

One float32 engine serves the whole module (uvicorn in a background thread); it speculates
with the Lookahead Cache, so every test also runs steps that emit several tokens. The
greedy references come from that same engine, run directly before the server takes it
over without speculation.
"""
from __future__ import annotations

import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from runtime.async_engine import AsyncEngine  # noqa: E402
from runtime.config import EngineConfig  # noqa: E402
from runtime.engine import LLMEngine  # noqa: E402
from runtime.sampling_params import SamplingParams  # noqa: E402
from runtime.serve import build_app  # noqa: E402

MODEL = "smollm2-135m"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 12
METRIC_NAMES = ("heterospec_requests_total", "heterospec_generation_tokens_total",
                "heterospec_time_to_first_token_seconds", "heterospec_time_per_output_token_seconds",
                "heterospec_e2e_request_latency_seconds", "heterospec_num_requests_running",
                "heterospec_num_requests_waiting", "heterospec_kv_cache_used_blocks",
                "heterospec_kv_cache_free_blocks", "heterospec_spec_draft_tokens_total",
                "heterospec_spec_accepted_tokens_total", "heterospec_spec_verify_steps_total",
                "heterospec_spec_accepted_per_position_total", "heterospec_target_forward_passes_total",
                "heterospec_verify_busy_seconds_total", "heterospec_overlap_seconds_total",
                "heterospec_prefix_cache_queries_total", "heterospec_prefix_cache_hits_total",
                "heterospec_prefix_cache_hit_rate", "heterospec_prefix_cache_blocks")
ABORTED = 'heterospec_requests_total{finish_reason="abort"}'


@dataclass
class Served:
    base_url: str
    engine: LLMEngine
    completion_ref: str  # greedy text of PROMPT, MAX_TOKENS tokens, run on the engine directly
    chat_ref: str

    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="x", max_retries=0, timeout=60)


def run_directly(engine: LLMEngine, prompt, params: SamplingParams) -> str:
    request_id = engine.add_request(prompt, params)
    text = None
    while engine.has_unfinished:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                text = out.text
    return text


@contextmanager
def serving(app):
    """uvicorn on a free port of 127.0.0.1 in a background thread; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@contextmanager
def serving_engine(engine, **app_options):
    """engine behind the server (runtime.serve.build_app's options) on a free port; yields the
    base URL, and shuts the engine's loop down after."""
    async_engine = AsyncEngine(engine)
    try:
        with serving(build_app(async_engine, MODEL, **app_options)) as base_url:
            yield base_url
    finally:
        async_engine.shutdown()


@pytest.fixture(scope="module")
def served():
    engine = LLMEngine(EngineConfig(enforce_eager=True, dtype="float32", device="cpu", kv_cache_memory="256MiB", max_num_seqs=8,
                                    speculator="lookahead", adaptive_speculation=False))
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, speculator="none")
    completion_ref = run_directly(engine, PROMPT, greedy)
    chat_ref = run_directly(engine, CHAT, greedy)
    with serving_engine(engine) as base_url:
        yield Served(base_url, engine, completion_ref, chat_ref)


def eventually(condition: Callable[[], bool], timeout: float = 10.0, what: str | Callable[[], str] = "") -> None:
    """The engine loop runs asynchronously: poll until `condition()` holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.05)


def wait_idle(engine: LLMEngine) -> None:
    """Every request gone and every KV block back in the free list."""
    bm = engine.block_manager
    eventually(lambda: not (engine.has_unfinished or engine.requests) and bm.num_free_blocks == bm.num_blocks,
               what=lambda: f"{bm.num_free_blocks}/{bm.num_blocks} blocks free, {len(engine.requests)} requests left")


def metric(base_url: str, sample: str) -> float:
    text = httpx.get(f"{base_url}/metrics").text
    match = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def sse_events(lines) -> list:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


# ---- generation -------------------------------------------------------------------------------

def test_completion_matches_engine(served):
    resp = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert resp.object == "text_completion"
    assert resp.choices[0].text == served.completion_ref
    assert resp.choices[0].finish_reason in ("length", "stop")
    assert resp.usage.completion_tokens <= MAX_TOKENS
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_completion_of_token_ids(served):
    ids = served.engine.tokenize(PROMPT)
    resp = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert resp.choices[0].text == served.completion_ref
    assert resp.usage.prompt_tokens == len(ids)


def test_chat_completion_matches_engine(served):
    resp = served.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == served.chat_ref
    assert resp.usage.prompt_tokens == len(served.engine.tokenize(CHAT))


def test_streaming_completion_equals_non_streaming(served):
    stream = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                              stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == served.completion_ref
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_streaming_chat_equals_non_streaming_with_usage(served):
    stream = served.client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=MAX_TOKENS,
                                                   temperature=0, stream=True,
                                                   stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == served.chat_ref
    assert with_choices[-1].choices[0].finish_reason in ("length", "stop")
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens <= MAX_TOKENS and usage.prompt_tokens == len(served.engine.tokenize(CHAT))
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_sse_ends_with_done(served):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{served.base_url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["object"] == "text_completion" for e in events[:-1])


def test_stop_string(served):
    words = served.completion_ref.split()
    assert len(words) >= 3, served.completion_ref
    stop = words[2]
    expected = served.completion_ref[:served.completion_ref.index(stop)]
    resp = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            stop=[stop, "no such text"])
    assert resp.choices[0].text == expected
    assert resp.choices[0].finish_reason == "stop"


def test_concurrent_requests_all_complete(served):
    prompts = [f"Write a sentence about the number {i}." for i in range(6)]

    def complete(prompt: str):
        return served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.7, seed=1)

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(complete, prompts))
    assert all(r.choices[0].finish_reason in ("length", "stop") for r in results)
    assert all(1 <= r.usage.completion_tokens <= 8 for r in results)
    wait_idle(served.engine)


def test_second_chat_turn_computes_only_the_new_turn(served):
    """Multi-turn chat: the second turn's prompt is the first turn's prompt and answer plus
    the new message; the prefix cache serves all of the first turn's full blocks, so the
    prompt tokens computed are the new turn's, plus at most the block the turns share
    partly. (usage.prompt_tokens_details.cached_tokens, OpenAI's field.)"""
    engine, bs = served.engine, served.engine.config.block_size
    turn1 = [{"role": "system", "content": "You answer in one short sentence. " * 6},
             {"role": "user", "content": "Name a river in Europe."}]
    first = served.client.chat.completions.create(model=MODEL, messages=turn1, max_tokens=MAX_TOKENS, temperature=0)
    answer = first.choices[0].message.content
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And one in Asia?"}]
    second = served.client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=MAX_TOKENS,
                                                   temperature=0)
    ids1, ids2 = engine.tokenize(turn1), engine.tokenize(turn2)
    committed = ids1 + engine.tokenizer(answer, add_special_tokens=False).input_ids
    committed = committed[:len(ids1) + first.usage.completion_tokens - 1]  # the turn's last token had no KV
    common = next((i for i, (a, b) in enumerate(zip(committed, ids2)) if a != b), min(len(committed), len(ids2)))
    new_turn = len(ids2) - common
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert second.usage.prompt_tokens == len(ids2)
    assert cached >= len(ids1) // bs * bs, "the first turn's prompt was not served from the cache"
    assert new_turn <= len(ids2) - cached < new_turn + bs
    assert metric(served.base_url, "heterospec_prefix_cache_hits_total") >= cached


# ---- the other endpoints ----------------------------------------------------------------------

def test_models(served):
    models = served.client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_health(served):
    resp = httpx.get(f"{served.base_url}/health")
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}


def test_metrics_names(served):
    served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    resp = httpx.get(f"{served.base_url}/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    for name in METRIC_NAMES:
        assert name in resp.text, name
    assert metric(served.base_url, "heterospec_generation_tokens_total") >= 2


def test_speculation_counters(served):
    before = {name: metric(served.base_url, f"heterospec_spec_{name}_total")
              for name in ("draft_tokens", "accepted_tokens", "verify_steps")}
    copy = "Repeat exactly: one two three four five six seven eight nine ten. Again: one two three"
    served.client.completions.create(model=MODEL, prompt=copy, max_tokens=48, temperature=0)
    after = {name: metric(served.base_url, f"heterospec_spec_{name}_total") for name in before}
    assert after["verify_steps"] > before["verify_steps"]
    assert after["draft_tokens"] > before["draft_tokens"] and after["accepted_tokens"] > before["accepted_tokens"]
    first = metric(served.base_url, 'heterospec_spec_accepted_per_position_total{position="1"}')
    assert 0 < first <= after["verify_steps"]


# ---- bad input: always a 400 with OpenAI's error body ------------------------------------------

def assert_error(resp: httpx.Response, status: int = 400, *words: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"], error["message"]
    return error


def test_malformed_json(served):
    resp = httpx.post(f"{served.base_url}/v1/chat/completions", content=b'{"messages": [',
                      headers={"content-type": "application/json"})
    assert_error(resp, 400, "JSON")


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"model": MODEL}, "messages"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": [PROMPT, PROMPT]}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "n": 0}, "n"),
    ("/v1/completions", {"prompt": PROMPT, "n": 10_000}, "n"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "speculation": {"method": "psychic"}}, "speculation"),
    ("/v1/completions", {"prompt": PROMPT, "speculation": {"method": "ngram", "num_speculative_tokens": -1}},
     "speculation"),
    ("/v1/completions", {"prompt": PROMPT, "speculation": {"method": "ngram", "tokens": 4}}, "speculation"),
    ("/v1/completions", {"prompt": PROMPT, "speculation": "sometimes"}, "speculation"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages"),  # OpenAI: 400, content is required
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": None}, *CHAT]}, "messages"),
    ("/v1/completions", [PROMPT], "body"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "seed": 2**64}, "seed"),  # beyond a torch.Generator's seeds
    # the JSON type OpenAI's API asks for, not one that converts to it
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": "16"}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": True}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "n": 2.0}, "n"),
    ("/v1/completions", {"prompt": PROMPT, "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": PROMPT, "stop_token_ids": ["2"]}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs"),
    # OpenAI fields not implemented here: refused, unless they hold their no-op value
    ("/v1/chat/completions", {"messages": CHAT, "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/chat/completions", {"messages": CHAT, "frequency_penalty": -1}, "frequency_penalty"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"42": -100}}, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "echo": True}, "echo"),
    ("/v1/completions", {"prompt": PROMPT, "suffix": "end"}, "suffix"),
    ("/v1/completions", {"prompt": PROMPT, "best_of": 3}, "best_of"),
])
def test_bad_fields(served, path, body, param):
    error = assert_error(httpx.post(f"{served.base_url}{path}", json=body))
    assert error["param"] == param


def test_invalid_utf8_body(served):
    resp = httpx.post(f"{served.base_url}/v1/completions", content=b'{"prompt": "caf\xe9 \xff"}',
                      headers={"content-type": "application/json"})
    assert_error(resp)
    assert httpx.get(f"{served.base_url}/health").status_code == 200


def test_negative_temperature(served):
    with pytest.raises(openai.BadRequestError) as info:
        served.client.chat.completions.create(model=MODEL, messages=CHAT, temperature=-1)
    assert info.value.status_code == 400
    assert "temperature" in info.value.message


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_temperature_is_a_finite_number(served, value):
    """Python's JSON parser takes NaN and Infinity; NaN sampled 40 empty tokens."""
    content = f'{{"prompt": {json.dumps(PROMPT)}, "max_tokens": 2, "temperature": {value}}}'.encode()
    resp = httpx.post(f"{served.base_url}/v1/completions", content=content, headers={"content-type": "application/json"})
    assert assert_error(resp, 400, "temperature")["param"] == "temperature"


def test_unknown_fields_are_ignored(served):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "frobnicate": {"x": 1},
            "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "echo": False, "best_of": 1}  # no-ops
    resp = httpx.post(f"{served.base_url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"]


def test_prompt_too_long(served):
    max_len = served.engine.max_model_len
    prompt = [1] * (max_len - 4)
    with pytest.raises(openai.BadRequestError) as info:
        served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=10)
    assert str(max_len) in info.value.message and str(max_len + 6) in info.value.message
    resp = httpx.post(f"{served.base_url}/v1/completions", json={"prompt": [1] * max_len})
    assert_error(resp, 400, str(max_len))


# ---- nothing is lost --------------------------------------------------------------------------

def start_long_stream(served: Served) -> None:
    """Open a stream that would run for minutes, read a few chunks, then hang up."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{served.base_url}/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        got = [line for _, line in zip(range(3), filter(None, lines))]
        assert len(got) == 3 and served.engine.block_manager.num_used_blocks > 0


def test_streaming_disconnect_aborts(served):
    wait_idle(served.engine)
    aborted = metric(served.base_url, ABORTED)
    start_long_stream(served)
    wait_idle(served.engine)
    eventually(lambda: metric(served.base_url, ABORTED) == aborted + 1, what="the abort was not counted")


def test_non_streaming_disconnect_aborts(served):
    wait_idle(served.engine)
    aborted = metric(served.base_url, ABORTED)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served.base_url}/v1/completions", json=body, timeout=httpx.Timeout(30.0, read=1.0))
    wait_idle(served.engine)
    eventually(lambda: metric(served.base_url, ABORTED) == aborted + 1, what="the abort was not counted")


def test_all_blocks_returned(served):
    wait_idle(served.engine)
    assert served.engine.block_manager.num_free_blocks == served.engine.block_manager.num_blocks


def test_long_prompt_joins_a_decoding_batch(served):
    """A prompt longer than one decode step arrives while another request decodes: both
    run in the same steps (a mixed prefill + decode batch) and both complete."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{served.base_url}/v1/completions", json=body, timeout=60) as resp:
        lines = filter(None, resp.iter_lines())
        next(lines), next(lines)  # the first request is decoding now
        chat = served.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
        rest = list(lines)
    assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.prompt_tokens > 16
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][len("data: "):])["choices"][0]["finish_reason"]
    wait_idle(served.engine)


# ---- a dead engine loop -----------------------------------------------------------------------

class BrokenEngine:
    """Takes requests, then fails on the first step."""

    max_model_len = 64

    def __init__(self):
        self.has_unfinished = False
        self.scheduler = SimpleNamespace(waiting=[])

    def prompt_token_ids(self, prompt) -> list[int]:
        return [1, 2, 3]

    def add_request(self, prompt, params, request_id):
        self.has_unfinished = True
        return request_id

    def abort(self, request_id) -> bool:
        return False

    def check_health(self) -> None:
        pass

    def step(self):
        raise RuntimeError("boom")


def test_dead_engine_loop_fails_requests_and_health():
    async_engine = AsyncEngine(BrokenEngine())
    with serving(build_app(async_engine, MODEL)) as base_url:
        assert httpx.get(f"{base_url}/health").status_code == 200
        first = httpx.post(f"{base_url}/v1/completions", json={"prompt": "x"}, timeout=30)
        assert first.status_code == 503 and "boom" in first.json()["error"]["message"]
        assert httpx.get(f"{base_url}/health").status_code == 503
        again = httpx.post(f"{base_url}/v1/chat/completions", json={"messages": CHAT}, timeout=30)
        assert again.status_code == 503 and again.json()["error"]["type"] == "service_unavailable"


def test_dead_engine_loop_ends_a_stream_with_an_error_event():
    async_engine = AsyncEngine(BrokenEngine())
    with serving(build_app(async_engine, MODEL)) as base_url:
        body = {"messages": CHAT, "stream": True}
        with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=30) as resp:
            events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    assert "boom" in json.loads(events[-2])["error"]["message"]


def test_dead_engine_loop_calls_on_death():
    """runtime.serve exits 1 through this callback when the engine loop dies."""
    deaths = []
    async_engine = AsyncEngine(BrokenEngine(), on_death=deaths.append)
    with serving(build_app(async_engine, MODEL)) as base_url:
        assert httpx.post(f"{base_url}/v1/completions", json={"prompt": "x"}, timeout=30).status_code == 503
    assert len(deaths) == 1 and "boom" in str(deaths[0])


def test_an_engine_built_by_a_function_is_built_on_the_loop_thread():
    """The thread that steps the engine is the one that loaded it (one OpenMP team:
    draft_cpu.placement)."""
    built_on = []

    def build():
        built_on.append(threading.get_native_id())
        return BrokenEngine()
    async_engine = AsyncEngine(build)
    assert built_on == [async_engine._thread.native_id] != [threading.get_native_id()]
    assert isinstance(async_engine.engine, BrokenEngine)


def test_an_engine_that_fails_to_build_raises_where_it_was_asked_for():
    def build():
        raise ValueError("no such model")
    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(build)

