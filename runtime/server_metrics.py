"""Prometheus metrics of one server app: requests by finish reason (stop, length, abort,
error), HTTP responses by status, prompt and generated tokens, TTFT/TPOT/e2e latency
histograms, preemptions, gauges of
running/waiting sequences, used/free KV cache blocks and the prefix cache (cached blocks,
hit rate; queries and hits as counters), and the engine's speculation
counters (draft tokens verified, accepted, verify steps, bonus/recovered tokens, accepted
per draft position, target forward passes, draft/verify/overlap seconds and the overlap
fraction, proposer failures and circuit breakers).

Each app has a registry of its own, so apps may share a process (the tests run several).
"""
from __future__ import annotations

from contextlib import aclosing
from typing import AsyncIterator, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.responses import Response

from runtime.async_engine import EngineDeadError
from runtime.engine import LLMEngine
from runtime.outputs import RequestOutput

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """The collectors of one app, updated as each request's outputs pass through `observe`.

    The gauges read the engine's queues and block pool at scrape time from the event loop
    thread; they are len() reads, atomic under the GIL, so a scrape never blocks a step.
    """

    def __init__(self, engine: LLMEngine):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("heterospec_requests", "Finished requests by finish reason "
                                "(stop, length, abort, error)", ["finish_reason"], registry=r)
        self.http_responses = Counter("heterospec_http_responses", "HTTP responses by status code", ["status"],
                                      registry=r)
        self.prompt_tokens = Counter("heterospec_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("heterospec_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("heterospec_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("heterospec_time_per_output_token_seconds", "Mean time per output token "
                              "after the first", buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("heterospec_e2e_request_latency_seconds", "Request latency from arrival "
                             "to the last token", buckets=LATENCY_BUCKETS, registry=r)
        self._gauge("heterospec_num_requests_running", "Sequences in the running batch",
                    lambda: len(engine.scheduler.running))
        self._gauge("heterospec_num_requests_waiting", "Sequences waiting to be scheduled",
                    lambda: len(engine.scheduler.waiting))
        self._gauge("heterospec_kv_cache_used_blocks", "KV cache blocks in use",
                    lambda: engine.block_manager.num_used_blocks)
        self._gauge("heterospec_kv_cache_free_blocks", "KV cache blocks free (cached prefixes that may be "
                    "evicted included)", lambda: engine.block_manager.num_free_blocks)
        self._gauge("heterospec_prefix_cache_blocks", "KV cache blocks holding a cached prefix (in use or "
                    "evictable)", lambda: engine.block_manager.num_cached_blocks)
        self._gauge("heterospec_spec_overlap_fraction", "Share of the target's busy time during which a draft "
                    "worker computed too, since start", lambda: engine.stats.overlap_fraction or 0.0)
        self._gauge("heterospec_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt "
                    "tokens, since start", lambda: engine.stats.prefix_cache_hit_rate or 0.0)
        r.register(_EngineStatsCollector(engine))

    def count_http_status(self, status: int) -> None:
        self.http_responses.labels(status=str(status)).inc()

    def _gauge(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        Gauge(name, documentation, registry=self.registry).set_function(read)

    # The /metrics endpoint, async so that it runs on the event loop (no docstring: FastAPI
    # would publish it in the OpenAPI schema).
    async def scrape(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def observe(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """Pass a request's outputs through, counting tokens and timing it when it ends."""
        reason = "abort"
        try:
            async with aclosing(outputs):
                async for out in outputs:
                    self.generation_tokens.inc(len(out.new_token_ids))
                    if out.finished:
                        reason = out.finish_reason or "stop"
                        self._observe_finished(out)
                    yield out
        except EngineDeadError:
            reason = "error"
            raise
        finally:
            self.requests.labels(finish_reason=reason).inc()

    def _observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        for histogram, seconds in ((self.ttft, m.ttft_s), (self.tpot, m.tpot_s), (self.e2e, m.e2e_s)):
            if seconds is not None:
                histogram.observe(seconds)


class _EngineStatsCollector:
    """The engine's counters (EngineStats), read at scrape time. Acceptance
    rate = accepted / draft tokens; mean acceptance length = 1 + accepted / verify steps;
    target forward passes per output token = steps / generated tokens."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine

    def collect(self):
        stats = self.engine.stats
        for name, documentation, value in (
                ("heterospec_spec_draft_tokens", "Draft tokens verified by the target", stats.num_draft_tokens),
                ("heterospec_spec_accepted_tokens", "Draft tokens accepted", stats.num_accepted_tokens),
                ("heterospec_spec_verify_steps", "Sequence steps that verified a draft", stats.num_verify_steps),
                ("heterospec_spec_bonus_tokens", "Verify steps whose whole path was accepted (bonus token)",
                 stats.num_bonus_tokens),
                ("heterospec_spec_recovered_tokens", "Verify steps ended by a rejection (recovered token)",
                 stats.num_recovered_tokens),
                ("heterospec_num_preemptions", "Sequences preempted (KV freed, recomputed later)",
                 stats.num_preemptions),
                ("heterospec_prefix_cache_queries", "Prompt tokens of scheduled requests (looked up in the prefix "
                 "cache)", stats.num_prompt_tokens_scheduled),
                ("heterospec_prefix_cache_hits", "Prompt tokens served from the prefix cache",
                 stats.num_cached_prompt_tokens),
                ("heterospec_target_forward_passes", "Target model forward passes (engine steps)", stats.num_steps),
                ("heterospec_target_tokens", "Tokens the target ran, draft nodes included",
                 stats.num_target_tokens),
                ("heterospec_draft_busy_seconds", "Time the draft worker computed", stats.draft_seconds),
                ("heterospec_verify_busy_seconds", "Time the target computed", stats.verify_seconds),
                ("heterospec_overlap_seconds", "Time draft worker and target computed at once "
                 "(overlap fraction = this / verify busy)", stats.overlap_seconds)):
            yield CounterMetricFamily(name, documentation, value=value)
        per_position = CounterMetricFamily("heterospec_spec_accepted_per_position",
                                           "Verify steps that accepted a draft token at this depth", labels=["position"])
        for depth, count in enumerate(list(stats.accepted_per_position), start=1):
            per_position.add_metric([str(depth)], count)
        yield per_position
        failures = CounterMetricFamily("heterospec_spec_proposer_failures", "Proposer calls that raised",
                                       labels=["proposer"])
        disabled = GaugeMetricFamily("heterospec_spec_proposer_disabled", "1 while a proposer's circuit breaker "
                                     "keeps its requests decoding without speculation", labels=["proposer"])
        for name, breaker in list(self.engine.pool.breakers.items()):
            failures.add_metric([name], breaker.num_failures)
            disabled.add_metric([name], float(breaker.is_open))
        yield failures
        yield disabled
