"""The engine: requests in, tokens out, one scheduled step at a time.

    step():  schedule -> (propose: nothing yet) -> run the target -> sample -> commit

The engine is the only place that knows the scheduler, the target worker and the
sampler together. It is not thread-safe: the server drives it from one loop thread.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from runtime.block_manager import BlockManager
from runtime.config import EngineConfig
from runtime.detokenizer import Detokenizer, DetokenizerState, find_stop
from runtime.models.loader import load_model
from runtime.sampling import Sampler
from runtime.sampling_params import SamplingParams
from runtime.scheduler import ScheduledBatch, Scheduler
from runtime.sequence import RequestMetrics, Sequence
from target_gpu.kv_cache import bytes_per_block, parse_memory
from target_gpu.model_runner import ModelRunner

log = logging.getLogger("runtime.engine")

Prompt = str | list[dict] | list[int]  # text, chat messages, or token ids


@dataclass(slots=True)
class RequestOutput:
    """What a request has produced so far (and what is new since the last step)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    text: str  # all output text so far (stop string removed)
    new_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics


@dataclass(slots=True)
class EngineStats:
    start_time: float = field(default_factory=time.perf_counter)
    num_steps: int = 0
    num_prompt_tokens_computed: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_finished: int = 0


@dataclass(slots=True)
class _RequestState:
    seq: Sequence
    detok: DetokenizerState = field(default_factory=DetokenizerState)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.config = config = config or EngineConfig(**kwargs)
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype(self.device)
        self.model, self.tokenizer, self.model_config = load_model(config.model, self.dtype, self.device)
        mc = self.model_config
        per_block = bytes_per_block(mc, config.block_size, self.model.dtype)
        pool_bytes = parse_memory(config.kv_cache_memory, self.device, config.kv_cache_default_fraction(self.device))
        num_blocks = pool_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"KV cache memory of {pool_bytes} bytes holds no block (one block is {per_block} bytes)")
        capacity = num_blocks * config.block_size
        if mc.max_context_len < mc.max_position_embeddings:
            log.warning("sliding window of %d tokens: max_model_len capped there (windowed attention is not "
                        "implemented)", mc.max_context_len)
        self.max_model_len = min(config.max_model_len or mc.max_context_len, mc.max_context_len, capacity)
        log.info("model %s (%s, %d layers) on %s in %s; KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB); "
                 "max_model_len %d", config.model, mc.architecture, mc.num_layers, self.device, self.dtype,
                 num_blocks, config.block_size, capacity, num_blocks * per_block / 2**20, self.max_model_len)
        self.kv_capacity_tokens = capacity
        self.runner = ModelRunner(self.model, mc, num_blocks, config.block_size, self.device)
        self.block_manager = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = Sampler(config.seed)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.requests: dict[str, _RequestState] = {}
        self.stats = EngineStats()
        self._next_id = 0

    # ---- requests -----------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt).input_ids
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            for m in prompt:
                if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise ValueError("each chat message needs a string 'role' and a string 'content'")
            text = self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False).input_ids
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            if any(t < 0 or t >= self.model_config.vocab_size for t in prompt):
                raise ValueError(f"prompt token ids must be in [0, {self.model_config.vocab_size})")
            return list(prompt)
        raise ValueError("a prompt is a non-empty string, a non-empty list of chat messages, or a list of token ids")

    def prompt_token_ids(self, prompt: Prompt) -> list[int]:
        """Tokenize and check that the prompt leaves room to generate; ValueError says why not."""
        token_ids = self.tokenize(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty after tokenization")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; the model's context is {self.max_model_len} "
                             f"tokens, which leaves no room to generate")
        return token_ids

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; raise ValueError before anything is scheduled."""
        params = params or SamplingParams()
        token_ids = self.prompt_token_ids(prompt)
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, token_ids, params, tuple(self.model_config.eos_token_ids))
        self.requests[request_id] = _RequestState(seq)
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> bool:
        state = self.requests.pop(request_id, None)
        if state is None or state.seq.is_finished:
            return False
        self.scheduler.finish(state.seq, "abort")
        return True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        self.stats.num_preemptions += batch.num_preempted
        if batch.is_empty:
            return []
        needs_logits = [seq.num_computed_tokens + n == seq.num_tokens
                        for seq, n in zip(batch.seqs, batch.num_new_tokens)]
        logits = self.runner.execute(batch.seqs, batch.num_new_tokens, needs_logits)  # [N, V]
        sampled = [seq for seq, needed in zip(batch.seqs, needs_logits) if needed]
        token_ids = self.sampler(logits, [s.params for s in sampled], [s.generator for s in sampled])
        return self._commit(batch, needs_logits, token_ids)

    def _commit(self, batch: ScheduledBatch, needs_logits: list[bool], token_ids: list[int]) -> list[RequestOutput]:
        outputs = []
        sampled_tokens = iter(token_ids)
        self.stats.num_steps += 1
        for seq, n, needed in zip(batch.seqs, batch.num_new_tokens, needs_logits):
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.stats.num_prompt_tokens_computed += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens += n
            if not needed:
                continue
            token = next(sampled_tokens)
            seq.append_token(token)
            self.stats.num_generated_tokens += 1
            outputs.append(self._advance(seq, token))
        return outputs

    def _advance(self, seq: Sequence, token: int) -> RequestOutput:
        """Detokenize the new token, apply the stop conditions, and report."""
        state = self.requests[seq.request_id]
        params = seq.params
        delta = self.detokenizer.delta(seq.output_token_ids, state.detok)
        reason = None
        if delta and params.stop:
            text = seq.output_text + delta
            at = find_stop(text, len(delta), params.stop)
            if at != -1:
                stop = next(s for s in params.stop if text.startswith(s, at))
                end = at + len(stop) if params.include_stop_str_in_output else at
                delta = text[len(seq.output_text):end] if end > len(seq.output_text) else ""
                reason = "stop"
        seq.output_text += delta
        if reason is None:
            if not params.ignore_eos and token in seq.eos_token_ids:
                reason = "stop"
            elif token in params.stop_token_ids:
                reason = "stop"
            elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self.requests.pop(seq.request_id, None)
            self.stats.num_finished += 1
        return RequestOutput(seq.request_id, seq.prompt_token_ids, seq.output_token_ids, seq.output_text,
                             [token], delta, reason is not None, reason, seq.metrics)
