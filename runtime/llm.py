"""Offline batch generation: `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Sequence as Seq

from tqdm import tqdm

from runtime.config import EngineConfig
from runtime.engine import LLMEngine, Prompt
from runtime.logprobs import TokenLogprobs
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams
from runtime.sequence import RequestMetrics


@dataclass(slots=True)
class Completion:
    """One sampled completion of a prompt."""
    index: int  # 0 .. n - 1 (SamplingParams.n)
    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: RequestMetrics  # .ttft_s .tpot_s .e2e_s .num_tokens
    # per output token (SamplingParams.logprobs set): .token_id .logprob .top [(token id, logprob), ...]
    logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class GenerationResult:
    """A prompt's completions: `outputs`, n of them (SamplingParams.n). `text`, `token_ids`,
    `finish_reason`, `metrics` and `logprobs` are the first completion's, the only one when n == 1."""
    prompt: Prompt
    prompt_token_ids: list[int]
    outputs: list[Completion]

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def metrics(self) -> RequestMetrics:
        return self.outputs[0].metrics

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self.outputs[0].logprobs


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
    def of(cls, results: list[GenerationResult], elapsed_s: float) -> RunSummary:
        """num_requests counts prompts; the rest sums or averages over every completion."""
        completions = [c for r in results for c in r.outputs]
        metrics = [c.metrics for c in completions]
        return cls(len(results), sum(len(c.token_ids) for c in completions), elapsed_s,
                   _mean(m.ttft_s for m in metrics), _mean(m.tpot_s for m in metrics),
                   sum(m.num_draft_tokens for m in metrics), sum(m.num_accepted_tokens for m in metrics),
                   sum(m.num_verify_steps for m in metrics), sum(m.num_prompt_tokens for m in metrics),
                   sum(m.num_cached_tokens for m in metrics))

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
        """One result per prompt, in order, holding its SamplingParams.n completions. All
        prompts are validated before any runs: on a ValueError, nothing is left queued."""
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
        choices = [sp.choices() for sp in sampling_params]
        ids: list[list[str]] = []  # the engine's request ids, per prompt, per choice
        try:
            for t, prompt_choices in zip(token_ids, choices):
                ids.append([])
                for choice in prompt_choices:
                    ids[-1].append(engine.add_request(t, choice))
        except BaseException:
            for rid in itertools.chain.from_iterable(ids):
                engine.abort(rid)
            raise
        start = time.perf_counter()
        finished = self._run(list(itertools.chain.from_iterable(ids)), use_tqdm)
        elapsed = time.perf_counter() - start
        results = [GenerationResult(p, t, [_completion(i, finished[r]) for i, r in enumerate(prompt_ids)])
                   for p, t, prompt_ids in zip(prompts, token_ids, ids)]
        self.last_summary = RunSummary.of(results, elapsed)
        return results

    def _run(self, request_ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        """Step the engine until it has nothing left to do: request id -> its last output. On
        an error or interrupt, the unfinished of request_ids are aborted (their blocks come back)."""
        engine = self.engine
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            try:
                while engine.has_unfinished:
                    for out in engine.step():
                        if out.finished:
                            finished[out.request_id] = out
                            bar.update(1)
            except BaseException:
                for rid in request_ids:
                    if rid not in finished:
                        engine.abort(rid)
                raise
        return finished


def _completion(index: int, out: RequestOutput) -> Completion:
    return Completion(index, out.text, out.token_ids, out.finish_reason, out.metrics, out.logprobs)
