"""Offline batch generation: `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence as Seq

from tqdm import tqdm

from runtime.config import EngineConfig
from runtime.engine import LLMEngine, Prompt
from runtime.logprobs import TokenLogprobs
from runtime.sampling_params import SamplingParams
from runtime.sequence import RequestMetrics


@dataclass(slots=True)
class GenerationResult:
    prompt: Prompt
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: RequestMetrics  # .ttft_s .tpot_s .e2e_s .num_tokens
    # per output token (SamplingParams.logprobs set): .token_id .logprob .top [(token id, logprob), ...]
    logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class RunSummary:
    num_requests: int
    num_output_tokens: int
    elapsed_s: float
    mean_ttft_s: float | None
    mean_tpot_s: float | None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @classmethod
    def of(cls, results: list["GenerationResult"], elapsed_s: float) -> "RunSummary":
        return cls(len(results), sum(len(r.token_ids) for r in results), elapsed_s,
                   _mean(r.metrics.ttft_s for r in results), _mean(r.metrics.tpot_s for r in results),
                   sum(r.metrics.num_draft_tokens for r in results),
                   sum(r.metrics.num_accepted_tokens for r in results),
                   sum(r.metrics.num_verify_steps for r in results),
                   sum(r.metrics.num_prompt_tokens for r in results),
                   sum(r.metrics.num_cached_tokens for r in results))

    def __str__(self) -> str:
        fmt = lambda x: "n/a" if x is None else f"{x * 1000:.1f} ms"  # noqa: E731
        text = (f"requests: {self.num_requests}  output tokens: {self.num_output_tokens}  "
                f"throughput: {self.output_tokens_per_s:.1f} tok/s  mean TTFT: {fmt(self.mean_ttft_s)}  "
                f"mean TPOT: {fmt(self.mean_tpot_s)}  prefix cache hit rate: "
                f"{self.num_cached_tokens / max(self.num_prompt_tokens, 1):.2f}")
        if self.num_verify_steps:
            text += (f"  draft tokens: {self.num_draft_tokens}  acceptance rate: "
                     f"{self.num_accepted_tokens / max(self.num_draft_tokens, 1):.2f}  mean acceptance length: "
                     f"{1 + self.num_accepted_tokens / self.num_verify_steps:.2f}")
        return text


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


class LLM:
    """Offline engine. Keyword arguments are EngineConfig fields (runtime.config: the
    engine's own, such as dtype, device, max_num_seqs, kv_cache_memory, quantization,
    tensor_parallel_size, speculator, num_speculative_tokens, and every registered
    speculator's settings, such as draft_model or eagle_head), e.g.
    LLM(speculator="lookahead", num_speculative_tokens=8) or
    LLM(model=target, speculator="draft", draft_model=path, draft_device="cpu", draft_cpu_cores="0-15").
    close() (or leaving a `with LLM(...) as llm:` block) stops its workers."""

    def __init__(self, model: str | None = None, **kwargs):
        if model is not None:
            kwargs["model"] = model
        self.engine = LLMEngine(EngineConfig(**kwargs))
        self.tokenizer = self.engine.tokenizer
        self.last_summary: RunSummary | None = None

    def close(self) -> None:
        """Stop the draft worker and the target's tensor-parallel ranks."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[GenerationResult]:
        """One result per prompt, in order. All prompts are validated before any runs: on a
        ValueError, nothing is left queued."""
        one_chat = isinstance(prompts, list) and prompts and isinstance(prompts[0], dict) \
            and "messages" not in prompts[0]  # chat messages, not a list of prompts
        if isinstance(prompts, (str, dict)) or one_chat:
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a prompt (a string, token ids, chat messages) or a list of prompts, "
                             f"got {type(prompts).__name__}")
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        engine = self.engine
        token_ids = [engine.prompt_token_ids(p) for p in prompts]  # fail before scheduling anything
        ids = []
        try:
            for t, sp in zip(token_ids, sampling_params):
                ids.append(engine.add_request(t, sp))
        except BaseException:
            for rid in ids:
                engine.abort(rid)
            raise
        finished = {}
        start = time.perf_counter()
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            try:
                while engine.has_unfinished:
                    for out in engine.step():
                        if out.finished:
                            finished[out.request_id] = out
                            bar.update(1)
            except BaseException:
                for rid in ids:
                    if rid not in finished:
                        engine.abort(rid)
                raise
        elapsed = time.perf_counter() - start
        results = [GenerationResult(p, finished[r].prompt_token_ids, finished[r].text, finished[r].token_ids,
                                    finished[r].finish_reason, finished[r].metrics, finished[r].logprobs)
                   for p, r in zip(prompts, ids)]
        self.last_summary = RunSummary.of(results, elapsed)
        return results
