"""The engine: requests in, tokens out, one scheduled step at a time.

    step():  propose -> schedule -> verify on the target -> accept -> commit

propose: each decoding sequence whose request speculates gets a draft tree from its
proposer, sized by the SpeculationController; schedule: the scheduler fits the trees into
the step's token budget and free blocks; verify: one target pass over every new token and
tree node; accept: the rejection sampler keeps the accepted path plus one bonus or
recovered token per sequence (plain decoding is the empty tree); commit: the accepted
path's KV is moved into place, the rest of the reserved blocks are released, proposers
hear what was kept. The engine is the only place that knows the scheduler, the target
worker, the proposers and the sampler together. It is not thread-safe: the server drives
it from one loop thread.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from runtime.block_manager import BlockManager
from runtime.circuit_breaker import CircuitBreaker
from runtime.config import EngineConfig
from runtime.detokenizer import Detokenizer, DetokenizerState, find_stop
from runtime.logprobs import TokenLogprobs, token_logprobs
from runtime.models.loader import load_model
from runtime.models.packed_linear import prepack_linears
from runtime.models.quant_linear import linear_kernels
from runtime.rejection_sampler import RejectionSampler, Verdict
from runtime.sampling_params import SamplingParams
from runtime.scheduler import ScheduledBatch, Scheduler
from runtime.sequence import RequestMetrics, Sequence, count_accepted_positions
from runtime.speculation import SpeculationController
from runtime.draft_tree import DraftTree
from runtime.outputs import RequestOutput
from speculators import ProposalRequest, Proposer, TargetInfo, build_proposer
from target_gpu.kv_cache import bytes_per_block, parse_memory
from target_gpu.model_runner import GraphLimits, ModelRunner

log = logging.getLogger("runtime.engine")

Prompt = str | list[dict] | list[int]  # text, chat messages, or token ids


@dataclass(slots=True)
class EngineStats:
    start_time: float = field(default_factory=time.perf_counter)
    num_steps: int = 0
    num_prompt_tokens_computed: int = 0  # prompt tokens the target ran (recomputation after preemption included)
    # prefix caching: prompt tokens of the requests scheduled so far, and those served from the cache
    num_prompt_tokens_scheduled: int = 0
    num_cached_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_finished: int = 0
    num_target_tokens: int = 0  # tokens the target ran (prompt chunks, decode tokens and draft nodes)
    # speculation: draft tokens verified, accepted, verify steps, and what ended each verify step
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    num_bonus_tokens: int = 0
    num_recovered_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [d - 1]: verify steps that accepted depth d
    # time (seconds): proposers' own workers busy, the target busy, both at once (docs/architecture.md, Overlap)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    overlap_seconds: float = 0.0
    timeline: deque = field(default_factory=lambda: deque(maxlen=4096))  # StepTiming of recent steps

    @property
    def overlap_fraction(self) -> float | None:
        """Share of the target's busy time during which a draft worker computed too."""
        return self.overlap_seconds / self.verify_seconds if self.verify_seconds else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.num_accepted_tokens / self.num_verify_steps if self.num_verify_steps else None

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Prompt tokens served from the prefix cache / prompt tokens scheduled."""
        return (self.num_cached_prompt_tokens / self.num_prompt_tokens_scheduled
                if self.num_prompt_tokens_scheduled else None)


@dataclass(slots=True)
class StepTiming:
    """One step's wall time split (seconds): draft worker busy, target busy, both at once."""

    wall: float
    draft: float
    verify: float
    overlap: float

    @property
    def idle(self) -> float:
        """Neither busy: scheduling, sampling, commit, Python between the two."""
        return max(0.0, self.wall - (self.draft + self.verify - self.overlap))


@dataclass(slots=True)
class _RequestState:
    seq: Sequence
    detok: DetokenizerState = field(default_factory=DetokenizerState)
    logprobs: list[TokenLogprobs] | None = None  # per output token, when params.logprobs is set


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.config = config = config or EngineConfig(**kwargs)
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype(self.device)
        self.model, self.tokenizer, self.model_config = load_model(config.model, self.dtype, self.device,
                                                                   config.quantization)
        if config.cpu_weight_prepack:
            prepack_linears(self.model)
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
        log.info("model %s (%s, %d layers) on %s in %s; linear layers: %s; KV cache: %d blocks x %d tokens = %d "
                 "tokens (%.1f MiB); max_model_len %d", config.model, mc.architecture, mc.num_layers, self.device,
                 self.dtype, linear_kernels(self.model),
                 num_blocks, config.block_size, capacity, num_blocks * per_block / 2**20, self.max_model_len)
        self.kv_capacity_tokens = capacity
        graphs = None
        if self.device.type == "cuda" and not config.enforce_eager:
            graphs = GraphLimits(config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len)
        self.runner = ModelRunner(self.model, mc, num_blocks, config.block_size, self.device,
                                  config.attention_backend, graphs,
                                  compile_decode=not config.enforce_eager and self.device.type == "cpu")
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = RejectionSampler(config.seed)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.requests: dict[str, _RequestState] = {}
        self.stats = EngineStats()
        self._next_id = 0
        self.proposers: dict[str, Proposer] = {}
        self.breakers: dict[str, CircuitBreaker] = {}  # per proposer: repeated failures turn it off a while
        self.spec_controller = SpeculationController(adaptive=config.adaptive_speculation)
        self.target_info = TargetInfo(mc.vocab_size, self.tokenizer, self.device, self.dtype, capacity,
                                      config.max_num_seqs, config.seed, self.model)
        if config.speculator != "none":
            self._proposer(config.speculator)  # fail at start on a bad setting
        if config.draft_model:
            self._proposer("draft")  # loaded now, so requests may ask for it
            log.info("speculation: %s, %d draft tokens per step, tree width %d, %s", config.speculator,
                     config.speculative_tokens(config.speculator), config.tree_width(config.speculator),
                     "adaptive" if config.adaptive_speculation else "fixed")

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

    def check_params(self, params: SamplingParams) -> None:
        """ValueError when the request asks for what this engine cannot do (beyond what
        SamplingParams checks by itself)."""
        if params.speculator not in (None, "none"):
            self._proposer(params.speculator)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; raise ValueError before anything is scheduled."""
        params = params or SamplingParams()
        token_ids = self.prompt_token_ids(prompt)
        self.check_params(params)
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, token_ids, params, tuple(self.model_config.eos_token_ids))
        name = params.speculator or self.config.speculator
        if name != "none" and self._proposer(name).needs_features:
            seq.reads_prefix_cache = False  # the proposer needs the target's features of every token
        self.requests[request_id] = _RequestState(seq, logprobs=None if params.logprobs is None else [])
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> bool:
        state = self.requests.pop(request_id, None)
        if state is None or state.seq.is_finished:
            return False
        self.scheduler.finish(state.seq, "abort")
        self._release(state.seq)
        return True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def close(self) -> None:
        """Stop the proposers' workers (the draft model's thread)."""
        for proposer in self.proposers.values():
            proposer.close()

    # ---- speculation --------------------------------------------------------------------
    def _proposer(self, name: str) -> Proposer:
        proposer = self.proposers.get(name)
        if proposer is None:
            proposer = self.proposers[name] = build_proposer(name, self.config, self.target_info)
            try:
                self.sync_feature_layers()
            except ValueError:
                self.proposers.pop(name).close()
                raise
        return proposer

    def sync_feature_layers(self) -> None:
        """Have the target hand out the layer inputs its loaded proposers read (EAGLE-3's),
        and no others (call after changing self.proposers by hand)."""
        wanted = {p.feature_layers for p in self.proposers.values() if p.feature_layers}
        if len(wanted) > 1:
            raise ValueError(f"the loaded proposers read different target layers: {sorted(wanted)}")
        self.runner.set_feature_layers(wanted.pop() if wanted else ())

    def _speculator_of(self, seq: Sequence) -> tuple[str, int]:
        """(speculator name, draft token cap) for seq this step; ("none", 0) when plain."""
        params = seq.params
        name = params.speculator or self.config.speculator
        if name == "none" or self._breaker(name).is_open:
            return "none", 0
        cap = (params.num_speculative_tokens if params.num_speculative_tokens is not None
               else self.config.speculative_tokens(name))
        # the step emits accepted + 1 tokens: stay within max_tokens and the context
        cap = min(cap, params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)
        return name, max(cap, 0)

    def _propose(self) -> tuple[int, int]:
        """Give each decoding sequence of the running batch this step's draft tree; returns
        the deepest tree's depth and the sum of the trees' depths ((0, 0) when nothing was
        proposed)."""
        decoding, names, caps = [], [], []
        for seq in self.scheduler.running:
            seq.draft_tree = None
            if seq.num_uncomputed_tokens != 1:
                continue
            name, cap = self._speculator_of(seq)
            if cap > 0:
                decoding.append(seq)
                names.append(name)
                caps.append(cap)
        if not decoding:
            return 0, 0
        budgets = self.spec_controller.budgets([s.request_id for s in decoding], caps)
        by_proposer: dict[str, list[tuple[Sequence, int]]] = {}
        depth = sequence_depths = 0
        for seq, name, budget in zip(decoding, names, budgets):
            if budget > 0:
                by_proposer.setdefault(name, []).append((seq, budget))
        for name, group in by_proposer.items():
            width = self.config.tree_width(name)
            requests = [ProposalRequest(seq.request_id, seq.token_ids, seq.num_prompt_tokens, budget, width,
                                        seq.params, seq.generator, seq.last_logits, seq.last_hidden,
                                        seq.pending_features)
                        for seq, budget in group]
            for seq, _ in group:  # the proposer has them now
                seq.pending_features = []
            try:
                trees = self._proposer(name).propose(requests)
            except Exception:  # a failing proposer costs its drafts, never the step
                log.exception("proposer %s failed; these sequences decode without drafts this step", name)
                self._breaker(name).record_failure()
                continue
            self._breaker(name).record_success()
            for (seq, budget), tree in zip(group, trees):
                if len(tree):
                    seq.draft_tree = tree.truncated(budget)
                    depth = max(depth, seq.draft_tree.max_depth)
                    sequence_depths += seq.draft_tree.max_depth
        return depth, sequence_depths

    def _breaker(self, name: str) -> CircuitBreaker:
        breaker = self.breakers.get(name)
        if breaker is None:
            breaker = self.breakers[name] = CircuitBreaker(name)
        return breaker

    def _tell_proposer(self, name: str, what: str, *args) -> None:
        """Call a proposer's bookkeeping hook; a failure there counts against it, never
        against the request."""
        try:
            getattr(self.proposers[name], what)(*args)
        except Exception:
            log.exception("proposer %s failed in %s", name, what)
            self._breaker(name).record_failure()

    def _release(self, seq: Sequence) -> None:
        """seq has left for good: its proposer and the controller forget it."""
        name = seq.params.speculator or self.config.speculator
        if name in self.proposers:
            self._tell_proposer(name, "release", seq.request_id)
        self.spec_controller.release(seq.request_id)

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        depth, sequence_depths = self._propose()
        proposed = time.perf_counter()
        if depth:
            self.spec_controller.observe_drafting(depth, sequence_depths, proposed - start)
        batch = self.scheduler.schedule()
        self.stats.num_preemptions += batch.num_preempted
        self.stats.num_prompt_tokens_scheduled += batch.num_prompt_tokens
        self.stats.num_cached_prompt_tokens += batch.num_cached_tokens
        if batch.is_empty:
            return []
        trees = [seq.draft_tree.truncated(n) if n else _EMPTY_TREE
                 for seq, n in zip(batch.seqs, batch.num_draft_tokens)]
        needs_logits = [seq.num_computed_tokens + n == seq.num_tokens
                        for seq, n in zip(batch.seqs, batch.num_new_tokens)]
        want_features = any(p.needs_features for p in self.proposers.values())
        want_hidden = want_features or any(p.needs_hidden_states for p in self.proposers.values())
        drafting_ahead = self._draft_ahead(batch.seqs, trees)
        verify_start = time.perf_counter()
        try:
            logits = self.runner.execute(batch.seqs, batch.num_new_tokens, needs_logits, trees,
                                         return_hidden="all" if want_features else want_hidden)
        finally:
            verify_end = time.perf_counter()
            for done in drafting_ahead:
                done.set()
        logits, hidden = logits if want_hidden else (logits, None)  # [R, V], [R or T, H]
        sampled = [i for i, needed in enumerate(needs_logits) if needed]
        verdicts = self.sampler(logits, [trees[i] for i in sampled], [batch.seqs[i].params for i in sampled],
                                [batch.seqs[i].generator for i in sampled])
        logprobs = self._logprobs([batch.seqs[i] for i in sampled], [trees[i] for i in sampled], verdicts, logits)
        if want_features:
            hidden = self._keep_features(batch, trees, needs_logits, verdicts, hidden)
        if want_hidden or any(p.needs_logits for p in self.proposers.values()):
            final_hidden = None if hidden is None else hidden[:, :self.model_config.hidden_size]  # [R, H]
            self._keep_last_outputs([batch.seqs[i] for i in sampled], [trees[i] for i in sampled], verdicts,
                                    logits, final_hidden)
        outputs = self._commit(batch, trees, needs_logits, verdicts, logprobs)
        end = time.perf_counter()
        self._record_timing(start, verify_start, verify_end, end)
        prefilling = any(not needed or n > 1 for n, needed in zip(batch.num_new_tokens, needs_logits))
        if not prefilling:
            self.spec_controller.observe_step(batch.num_tokens, end - proposed,
                                              has_drafts=any(batch.num_draft_tokens))
        return outputs

    def _draft_ahead(self, seqs: list[Sequence], trees: list[DraftTree]) -> list:
        """Let proposers with their own worker keep drafting while the target verifies."""
        by_proposer: dict[str, list[tuple[str, DraftTree]]] = {}
        for seq, tree in zip(seqs, trees):
            if len(tree):
                by_proposer.setdefault(seq.params.speculator or self.config.speculator, []).append(
                    (seq.request_id, tree))
        events = []
        for name, verifying in by_proposer.items():
            try:
                done = self.proposers[name].draft_ahead(verifying)
            except Exception:
                log.exception("proposer %s failed to draft ahead", name)
                self._breaker(name).record_failure()
                continue
            if done is not None:
                events.append(done)
        return events

    def _record_timing(self, start: float, verify_start: float, verify_end: float, end: float) -> None:
        draft = overlap = 0.0
        for proposer in self.proposers.values():
            draft += proposer.busy_between(start, end)
            overlap += proposer.busy_between(verify_start, verify_end)
        timing = StepTiming(end - start, draft, verify_end - verify_start, overlap)
        stats = self.stats
        stats.draft_seconds += timing.draft
        stats.verify_seconds += timing.verify
        stats.overlap_seconds += timing.overlap
        stats.timeline.append(timing)

    def _keep_features(self, batch: ScheduledBatch, trees: list[DraftTree], needs_logits: list[bool],
                       verdicts: list[Verdict], hidden: torch.Tensor) -> torch.Tensor:
        """Queue, for sequences whose proposer reads features (EAGLE), the target's hidden
        state of every token this step commits (prefill tokens, a tree's root and accepted
        nodes); hidden [T, H] holds every token run. Returns the rows of the logits [R, H]."""
        next_verdict = iter(verdicts)
        row = 0
        logit_rows = []
        for seq, n, tree, needed in zip(batch.seqs, batch.num_new_tokens, trees, needs_logits):
            verdict = next(next_verdict) if needed else None
            if needed:
                logit_rows.extend(range(row + n - 1, row + n + len(tree)))
            proposer = self.proposers.get(seq.params.speculator or self.config.speculator)
            if proposer is not None and proposer.needs_features:
                rows = list(range(row, row + n))
                if verdict is not None and len(tree):
                    rows += [row + 1 + node for node in verdict.accepted_nodes]
                seq.pending_features.append((seq.num_computed_tokens, hidden[rows]))
            row += n + len(tree)
        return hidden[logit_rows]

    @staticmethod
    def _logprobs(seqs: list[Sequence], trees: list[DraftTree], verdicts: list[Verdict],
                  logits: torch.Tensor) -> dict[str, list[TokenLogprobs]]:
        """Per request that asked for them, the logprobs of the tokens its verdict emits;
        logits [R, V] hold 1 + len(tree) rows per sequence (root, then the nodes)."""
        out = {}
        row_start = 0
        for seq, tree, verdict in zip(seqs, trees, verdicts):
            if seq.params.logprobs is not None:
                rows = [row_start] + [row_start + 1 + node for node in verdict.accepted_nodes]
                out[seq.request_id] = token_logprobs(logits[rows], verdict.token_ids, seq.params.logprobs)
            row_start += 1 + len(tree)
        return out

    @staticmethod
    def _keep_last_outputs(seqs: list[Sequence], trees: list[DraftTree], verdicts: list[Verdict],
                           logits, hidden) -> None:
        """Keep each sequence's target logits (and hidden state) at its last kept token, the
        row that produced the bonus or recovered token, for the next proposal."""
        row_start = 0
        for seq, tree, verdict in zip(seqs, trees, verdicts):
            row = row_start + (1 + verdict.accepted_nodes[-1] if verdict.accepted_nodes else 0)
            seq.last_logits = logits[row].clone()
            seq.last_hidden = None if hidden is None else hidden[row].clone()
            row_start += 1 + len(tree)

    def _commit(self, batch: ScheduledBatch, trees: list[DraftTree], needs_logits: list[bool],
                verdicts: list[Verdict], logprobs: dict[str, list[TokenLogprobs]]) -> list[RequestOutput]:
        outputs = []
        next_verdict = iter(verdicts)
        src_slots: list[int] = []
        dst_slots: list[int] = []
        stats = self.stats
        stats.num_steps += 1
        stats.num_target_tokens += batch.num_tokens
        for seq, n, tree, needed in zip(batch.seqs, batch.num_new_tokens, trees, needs_logits):
            seq.draft_tree = None
            seq.metrics.num_target_forwards += 1
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                stats.num_prompt_tokens_computed += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens += n
            if not needed:
                self.block_manager.cache_committed_blocks(seq)
                continue
            verdict = next(next_verdict)
            if len(tree):
                root = seq.num_computed_tokens - 1  # the root's position; node i was written at root + 1 + i
                for depth, node in enumerate(verdict.accepted_nodes, start=1):
                    if node != depth - 1:
                        src_slots.append(self.block_manager.slot(seq, root + 1 + node))
                        dst_slots.append(self.block_manager.slot(seq, root + depth))
                seq.num_computed_tokens += len(verdict.accepted_nodes)
                self._record_verification(seq, tree, verdict)
            try:
                outputs.append(self._advance(seq, verdict.token_ids, logprobs.get(seq.request_id)))
            except Exception as e:  # this request fails alone; the batch goes on
                log.exception("request %s failed", seq.request_id)
                outputs.append(self._fail(seq, e))
            if not seq.is_finished:  # (a finished sequence's blocks were cached as they were freed)
                self.block_manager.truncate(seq, seq.num_computed_tokens)
                self.block_manager.cache_committed_blocks(seq)
                if len(tree):
                    self._tell_proposer(seq.params.speculator or self.config.speculator, "on_accepted",
                                        seq.request_id, seq.token_ids, len(verdict.accepted_nodes))
        self.runner.commit_accepted(src_slots, dst_slots)
        return outputs

    def _fail(self, seq: Sequence, error: Exception) -> RequestOutput:
        """End seq with finish reason "error" (its blocks come back) and say why."""
        state = self.requests.pop(seq.request_id, None)
        if not seq.is_finished:
            self.scheduler.finish(seq, "error")
            self._release(seq)
        self.stats.num_finished += 1
        return RequestOutput(seq.request_id, seq.prompt_token_ids, seq.output_token_ids, seq.output_text, [], "",
                             True, "error", seq.metrics, None if state is None else state.logprobs,
                             f"{type(error).__name__}: {error}")

    def _record_verification(self, seq: Sequence, tree: DraftTree, verdict: Verdict) -> None:
        num_accepted = len(verdict.accepted_nodes)
        seq.metrics.record_verification(len(tree), num_accepted)
        self.spec_controller.observe_verdict(seq.request_id, num_accepted, verdict.kind == "recovered")
        self.spec_controller.observe_tree(seq.request_id, tree.depths, verdict.accepted_nodes)
        stats = self.stats
        stats.num_draft_tokens += len(tree)
        stats.num_accepted_tokens += num_accepted
        stats.num_verify_steps += 1
        if verdict.kind == "bonus":
            stats.num_bonus_tokens += 1
        else:
            stats.num_recovered_tokens += 1
        count_accepted_positions(stats.accepted_per_position, num_accepted)

    def _advance(self, seq: Sequence, token_ids: list[int], logprobs: list[TokenLogprobs] | None) -> RequestOutput:
        """Append the step's tokens one by one (detokenize, apply the stop conditions) until
        they run out or the request finishes; report what was appended (and, when asked
        for, its logprobs)."""
        state = self.requests[seq.request_id]
        params = seq.params
        appended: list[int] = []
        delta_text = ""
        reason = None
        for token in token_ids:
            seq.append_token(token)
            appended.append(token)
            self.stats.num_generated_tokens += 1
            delta = self.detokenizer.delta(seq.output_token_ids, state.detok)
            if delta and params.stop:
                text = seq.output_text + delta
                at = find_stop(text, len(delta), params.stop)
                if at != -1:
                    stop = next(s for s in params.stop if text.startswith(s, at))
                    end = at + len(stop) if params.include_stop_str_in_output else at
                    delta = text[len(seq.output_text):end] if end > len(seq.output_text) else ""
                    reason = "stop"
            seq.output_text += delta
            delta_text += delta
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
                self._release(seq)
                self.stats.num_finished += 1
                break
        if state.logprobs is not None:
            state.logprobs.extend(logprobs[:len(appended)])
        return RequestOutput(seq.request_id, seq.prompt_token_ids, seq.output_token_ids, seq.output_text,
                             appended, delta_text, reason is not None, reason, seq.metrics,
                             None if state.logprobs is None else list(state.logprobs))


_EMPTY_TREE = DraftTree([], [])
