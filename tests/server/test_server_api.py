"""The server's production API over real HTTP with the `openai` client and raw requests:
n > 1, logprobs (against HF transformers), the per-request `speculation` field, usage
metrics, the API key, 429 with Retry-After, a request that fails alone, a failing proposer
behind its circuit breaker, and one structured log line per request."""
from __future__ import annotations

import json
import logging
import time

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from runtime.circuit_breaker import CircuitBreaker  # noqa: E402
from runtime.config import EngineConfig  # noqa: E402
from runtime.engine import LLMEngine  # noqa: E402
from runtime.sampling_params import SamplingParams  # noqa: E402
from runtime.serve import engine_config, parse_args  # noqa: E402
from speculators import Proposer  # noqa: E402
from tests.server.test_server import eventually, metric, run_directly, serving_engine, sse_events, wait_idle  # noqa: E402
from tests.helpers import toy_speculator

MODEL = "smollm2-135m"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
COPY = "Repeat exactly: one two three four five six seven eight nine ten. Again: one two three"


def make_engine(**kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(enforce_eager=True, dtype="float32", device="cpu", kv_cache_memory="128MiB", quantization="none",
                                  **kwargs))


@pytest.fixture(scope="module")
def server():
    """(base URL, engine): a float32 engine without speculation by default."""
    engine = make_engine(max_num_seqs=8)
    with serving_engine(engine) as base_url:
        yield base_url, engine


def client(base_url: str, api_key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=120)


# ---- n, seeds, usage -----------------------------------------------------------------------------

def test_n_choices(server):
    base_url, engine = server
    c = client(base_url)
    greedy = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, n=2)
    assert [ch.index for ch in greedy.choices] == [0, 1]
    assert greedy.choices[0].text == greedy.choices[1].text
    sampled = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=1.0, seed=3, n=3)
    texts = [ch.message.content for ch in sampled.choices]
    assert len(set(texts)) > 1, texts  # seeds 3, 4, 5
    again = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=1.0, seed=3, n=3)
    assert [ch.message.content for ch in again.choices] == texts
    assert 3 <= sampled.usage.completion_tokens <= 36
    wait_idle(engine)


def test_n_choices_streamed_with_usage(server):
    base_url, engine = server
    c = client(base_url)
    reference = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0.9, seed=11, n=2)
    stream = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0.9, seed=11, n=2,
                                  stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    texts = ["", ""]
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [ch.text for ch in reference.choices]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == reference.usage.completion_tokens
    wait_idle(engine)


def test_usage_metrics_extension(server):
    base_url, _ = server
    resp = httpx.post(f"{base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                                          "user": "someone"}, timeout=60).json()
    metrics = resp["usage"]["metrics"]
    assert resp["usage"]["completion_tokens"] == 6
    assert 0 < metrics["ttft_s"] <= metrics["e2e_s"] and metrics["tpot_s"] > 0
    assert metrics["draft_tokens"] == 0 and metrics["mean_acceptance_length"] is None


# ---- logprobs --------------------------------------------------------------------------------------

def hf_logprobs(hf_model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """HF transformers' log_softmax at each output position: [len(output), V]."""
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = hf_model(ids).logits[0, len(prompt_ids) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_completion_logprobs_match_hf(server, hf_smollm):
    base_url, engine = server
    resp = client(base_url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    prompt_ids = engine.tokenize(PROMPT)
    output_ids = engine.tokenize(PROMPT + resp.choices[0].text)[len(prompt_ids):]
    assert "".join(lp.tokens) == resp.choices[0].text and len(lp.tokens) == 8
    reference = hf_logprobs(hf_smollm, prompt_ids, output_ids[:8])
    expected = reference.gather(1, torch.tensor(output_ids[:8]).unsqueeze(1)).squeeze(1)
    assert torch.allclose(torch.tensor(lp.token_logprobs), expected, atol=1e-4)
    for position, top in enumerate(lp.top_logprobs):
        assert len(top) == 3
        values, _ = reference[position].topk(3)
        assert torch.allclose(torch.tensor(sorted(top.values(), reverse=True)), values, atol=1e-4)
        assert max(top.values()) == pytest.approx(lp.token_logprobs[position], abs=1e-6)  # greedy: the top token
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]


def test_chat_logprobs_streamed_equal_non_streamed(server):
    base_url, _ = server
    c = client(base_url)
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    whole = c.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == whole.choices[0].message.content
    assert all(len(entry.top_logprobs) == 2 and entry.bytes == list(entry.token.encode()) for entry in content)
    streamed = [entry for chunk in c.chat.completions.create(**kwargs, stream=True)
                for choice in chunk.choices if choice.logprobs for entry in choice.logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]


def test_logprobs_with_speculation_equal_plain(server):
    """The tokens a verify step emits get the rows of their parents: the same numbers as
    plain decoding."""
    base_url, _ = server
    body = {"prompt": COPY, "max_tokens": 16, "temperature": 0, "logprobs": 1}
    plain = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).json()
    spec = httpx.post(f"{base_url}/v1/completions", json={**body, "speculation": {"method": "ngram"}},
                      timeout=60).json()
    assert spec["usage"]["metrics"]["accepted_tokens"] > 0
    a, b = plain["choices"][0]["logprobs"], spec["choices"][0]["logprobs"]
    assert a["tokens"] == b["tokens"]
    assert a["token_logprobs"] == pytest.approx(b["token_logprobs"], abs=1e-4)


# ---- the speculation field -----------------------------------------------------------------------

def test_speculation_field_per_request(server):
    base_url, engine = server
    greedy = {"prompt": COPY, "max_tokens": 16, "temperature": 0}
    plain = httpx.post(f"{base_url}/v1/completions", json=greedy, timeout=60).json()
    spec = httpx.post(f"{base_url}/v1/completions", timeout=60,
                      json={**greedy, "speculation": {"method": "lookahead", "num_speculative_tokens": 4}}).json()
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    assert plain["usage"]["metrics"]["draft_tokens"] == 0
    assert 0 < spec["usage"]["metrics"]["draft_tokens"] <= 4 * spec["usage"]["metrics"]["verify_steps"]
    off = httpx.post(f"{base_url}/v1/completions", json={**greedy, "speculation": "off"}, timeout=60).json()
    assert off["usage"]["metrics"]["draft_tokens"] == 0
    missing = httpx.post(f"{base_url}/v1/completions", json={**greedy, "speculation": {"method": "draft"}},
                         timeout=60)
    assert missing.status_code == 400 and "--draft-model" in missing.json()["error"]["message"]
    wait_idle(engine)


def test_the_server_builds_weighty_speculators_at_start_only():
    """A request for EAGLE (the default model ships a head), not built at start, is a 400 that
    says how to build it, and nothing is loaded; model-free speculators are built for it. With
    --speculators eagle the head is built at start and requests may use it, also combined."""
    flags = ["--enforce-eager", "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "128MiB",
             "--quantization", "none", "--speculator", "lookahead", "--no-adaptive-speculation"]
    engine = LLMEngine(engine_config(parse_args(flags)))
    greedy = {"prompt": COPY, "max_tokens": 12, "temperature": 0}
    with serving_engine(engine) as base_url:
        for method in ("eagle", "eagle+lookahead"):
            refused = httpx.post(f"{base_url}/v1/completions", json={**greedy, "speculation": {"method": method}},
                                 timeout=60)
            assert refused.status_code == 400, refused.text
            assert "--speculators eagle" in refused.json()["error"]["message"]
        plain = httpx.post(f"{base_url}/v1/completions", json={**greedy, "speculation": "off"}, timeout=60).json()
        ngram = httpx.post(f"{base_url}/v1/completions", json={**greedy, "speculation": {"method": "ngram"}},
                           timeout=60).json()
        assert ngram["choices"][0]["text"] == plain["choices"][0]["text"]
        assert sorted(engine.pool.proposers) == ["lookahead", "ngram"]
    engine = LLMEngine(engine_config(parse_args(flags + ["--speculators", "eagle"])))
    assert sorted(engine.pool.proposers) == ["eagle", "lookahead"]
    with serving_engine(engine) as base_url:
        for method in ("eagle", "eagle+lookahead"):
            out = httpx.post(f"{base_url}/v1/completions", json={**greedy, "speculation": {"method": method}},
                             timeout=60).json()
            assert out["choices"][0]["text"] == plain["choices"][0]["text"]
            assert out["usage"]["metrics"]["draft_tokens"] > 0


@pytest.mark.parametrize("speculators, words", [("psychic", "unknown speculator"), ("medusa", "--medusa-heads")])
def test_bad_start_speculators_fail_at_start(speculators, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(speculators=speculators)


# ---- auth and back-pressure ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def guarded():
    """(base URL, engine): one sequence at a time, one request may wait, API key 'sekret'."""
    engine = make_engine(max_num_seqs=1)
    with serving_engine(engine, api_key="sekret", max_waiting_requests=1) as base_url:
        yield base_url, engine


def test_api_key(guarded):
    base_url, _ = guarded
    assert httpx.get(f"{base_url}/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        resp = httpx.get(f"{base_url}/v1/models", headers=headers)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{base_url}/metrics").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        client(base_url, "wrong").completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    ok = client(base_url, "sekret").completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_full_queue_is_429_with_retry_after(guarded):
    """One request runs, one waits; the next is refused at once with Retry-After, and once
    the queue drains requests are taken again."""
    base_url, engine = guarded
    auth = {"Authorization": "Bearer sekret"}
    long_body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120, headers=auth) as http:
        with http.stream("POST", f"{base_url}/v1/completions", json=long_body) as running:
            running_lines = running.iter_lines()  # kept: a dropped iterator would close the response
            next(running_lines)
            with http.stream("POST", f"{base_url}/v1/completions", json=long_body) as waiting:
                eventually(lambda: len(engine.scheduler.waiting) == 1, what="the second request never queued")
                refused = httpx.post(f"{base_url}/v1/completions", headers=auth, json={"prompt": PROMPT})
                assert refused.status_code == 429, refused.text
                assert refused.json()["error"]["type"] == "rate_limit_error"
                assert 1 <= int(refused.headers["Retry-After"]) <= 60
                assert waiting.status_code == 200
    wait_idle(engine)
    again = httpx.post(f"{base_url}/v1/completions", headers=auth, json={"prompt": PROMPT, "max_tokens": 2})
    assert again.status_code == 200
    assert metric_with_key(base_url, 'heterospec_http_responses_total{status="429"}') >= 1


def metric_with_key(base_url: str, sample: str) -> float:
    text = httpx.get(f"{base_url}/metrics", headers={"Authorization": "Bearer sekret"}).text
    line = next((ln for ln in text.splitlines() if ln.startswith(sample + " ")), None)
    return float(line.split()[-1]) if line else 0.0


# ---- faults ------------------------------------------------------------------------------------------

def test_a_request_that_fails_alone_is_a_500(server, monkeypatch):
    """Detokenization raising for one request (its prompt is the poisoned one) fails that
    request: a 500, or an error event when streaming. The server goes on serving, with the
    same outputs as before."""
    base_url, engine = server
    detokenizer = engine.outputs.detokenizer
    delta = detokenizer.delta
    poisoned = engine.tokenize("Poisoned prompt:")

    def failing_delta(output_ids, state):  # runs on the engine loop thread
        owner = next(r.seq for r in engine.requests.values() if r.detok is state)
        if owner.prompt_token_ids == poisoned and len(output_ids) >= 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected for the test")
        return delta(output_ids, state)

    good = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    reference = run_directly_via_http(base_url, good)
    monkeypatch.setattr(detokenizer, "delta", failing_delta)
    bad = {"prompt": "Poisoned prompt:", "max_tokens": 8, "ignore_eos": True}
    resp = httpx.post(f"{base_url}/v1/completions", json=bad, timeout=60)
    assert resp.status_code == 500 and resp.json()["error"]["type"] == "internal_error"
    assert "injected for the test" in resp.json()["error"]["message"]
    with httpx.stream("POST", f"{base_url}/v1/completions", json={**bad, "stream": True}, timeout=60) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and "injected" in json.loads(events[-2])["error"]["message"]
    assert run_directly_via_http(base_url, good) == reference
    assert httpx.get(f"{base_url}/health").status_code == 200
    wait_idle(engine)


def run_directly_via_http(base_url: str, body: dict) -> str:
    resp = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


class ExplodingProposer(Proposer):
    """Raises on every call."""

    def __init__(self):
        self.calls = 0

    def propose(self, requests):
        self.calls += 1
        raise RuntimeError("the draft worker crashed")


def test_failing_proposer_opens_its_breaker_and_requests_decode_plain():
    exploding = ExplodingProposer()
    engine = make_engine(max_num_seqs=4, speculator=toy_speculator("exploding", exploding))
    plain = run_directly(engine, COPY, SamplingParams(max_tokens=24, temperature=0, speculator="none"))
    with serving_engine(engine) as base_url:
        text = run_directly_via_http(base_url, {"prompt": COPY, "max_tokens": 24, "temperature": 0})
        assert text == plain
        breaker = engine.pool.breakers["exploding"]
        assert breaker.is_open and exploding.calls == breaker.max_failures
        assert metric(base_url, 'heterospec_spec_proposer_failures_total{proposer="exploding"}') == 3
        assert metric(base_url, 'heterospec_spec_proposer_disabled{proposer="exploding"}') == 1
        assert httpx.get(f"{base_url}/health").status_code == 200


def test_circuit_breaker_cools_down_then_retries():
    now = [0.0]
    breaker = CircuitBreaker("x", max_failures=2, cooldown_s=10, max_cooldown_s=25, clock=lambda: now[0])
    breaker.record_failure()
    assert not breaker.is_open
    breaker.record_success()
    breaker.record_failure()
    assert not breaker.is_open  # successes reset the count
    breaker.record_failure()
    assert breaker.is_open
    now[0] = 10.0
    assert not breaker.is_open  # cooled down: the next call is a trial
    breaker.record_failure()  # the trial fails: open again, twice as long
    assert breaker.is_open and breaker.open_until == 30.0
    now[0] = 30.0
    breaker.record_failure()
    assert breaker.open_until == 55.0  # capped at 25 s
    now[0] = 55.0
    breaker.record_success()
    assert not breaker.is_open and breaker.failures_in_a_row == 0
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.open_until == 65.0  # the cooldown starts over after a success


def test_one_structured_log_line_per_request(server, caplog):
    base_url, _ = server
    with caplog.at_level(logging.INFO, logger="runtime.requests"):
        # greedy: a sampled completion may end at EOS within 3 tokens
        resp = httpx.post(f"{base_url}/v1/completions",
                          json={"prompt": PROMPT, "max_tokens": 3, "n": 2, "temperature": 0}, timeout=60).json()
        eventually(lambda: sum(r.name == "runtime.requests" for r in caplog.records) >= 2)
        time.sleep(0.2)
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "runtime.requests"]
    assert sorted(line["id"] for line in lines) == [f"{resp['id']}-0", f"{resp['id']}-1"]
    for line in lines:
        assert line["status"] == "length" and line["completion_tokens"] == 3
        assert line["prompt_tokens"] == resp["usage"]["prompt_tokens"] and line["ttft_s"] > 0
