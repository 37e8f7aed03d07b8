"""The engine: requests in, tokens out, one scheduled step at a time.

    step():  propose -> schedule -> verify on the target -> accept -> commit

propose: a draft tree for each decoding sequence that speculates, sized from measured
acceptance and costs (runtime.proposer_pool); schedule: the trees fit into the step's
token budget and free blocks; verify: one target pass over every new token and tree node
(runtime.verify_layout); accept: the rejection sampler keeps the accepted path plus one
bonus or recovered token a sequence; commit: the path's KV moves into place, the rest of
the reserved blocks come back, proposers hear what was kept. Only the engine knows the
scheduler, target, proposers and sampler together (docs/architecture.md, One decode
step). Not thread-safe: the server drives it from one loop thread.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import sys
import time
from functools import partial

import torch

from draft_cpu.placement import on_a_thread_of_its_own, parse_core_list
from runtime.block_manager import BlockManager
from runtime.config import SPECULATION_ARGS, EngineConfig, with_index
from runtime.logprobs import TokenLogprobs, layout_logprobs
from runtime.models.loader import load_model
from runtime.models.packed_linear import prepack_linears
from runtime.models.quant_linear import linear_kernels
from runtime.output_processor import OutputProcessor, RequestState
from runtime.outputs import RequestOutput
from runtime.prompts import Prompt, tokenize
from runtime.proposer_pool import ProposerPool
from runtime.rejection_sampler import RejectionSampler, Verdict
from runtime.sampling_params import SamplingParams
from runtime.scheduler import Scheduler
from runtime.sequence import Sequence
from runtime.stats import EngineStats, StepTiming
from runtime.structured_output import Grammars, StepMasks
from runtime.verify_layout import VerifyLayout
from speculators import TargetInfo
from target_gpu.kv_cache import num_kv_blocks
from target_gpu.context_parallel import CPRunner
from target_gpu.model_runner import GraphLimits, ModelRunner
from target_gpu.tensor_parallel import TPRunner
from target_gpu.tp_launch import run_node

log = logging.getLogger("runtime.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.config = config = config or EngineConfig(**kwargs)
        launch = config.tp_launch()
        if launch is not None and launch.rank != 0:  # another node's ranks, or a torchrun rank > 0
            sys.exit(run_node(launch))
        self.device = with_index(config.resolved_device())  # cuda:N, as its tensors say (ranks > 0 left above)
        self.dtype = config.resolved_dtype(self.device)
        quantization = config.resolved_quantization(launch)
        self._ranks_per_host = launch.ranks_per_node if launch is not None else 1
        load_device = torch.device("cpu") if launch is not None else self.device  # sharded before it moves
        # loading uses every core; the OpenMP workers it starts end with the loading thread
        # (draft_cpu.placement: a GPU target's thread, or a CPU target's beside a pinned draft, needs fewer)
        self.model, self.tokenizer, self.model_config = on_a_thread_of_its_own(load_model, config.model, self.dtype,
                                                                               load_device, quantization)
        if launch is not None:
            draft_cores = getattr(config, "draft_cpu_cores", None)  # kept free of the target's ranks
            ring = config.context_parallel_size > 1
            self.runner = (partial(CPRunner, min_tokens=config.cp_min_tokens) if ring else TPRunner)(
                self.model, config.model, self.dtype, quantization, launch, self._size_kv_pool, config.block_size,
                config.attention_backend, parse_core_list(draft_cores) if draft_cores else [])
        else:
            self.runner = self._make_runner()
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                          self.model_config.sliding_window)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = RejectionSampler(config.seed)
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids)
        self.requests: dict[str, RequestState] = {}
        self.stats = EngineStats()
        self._request_ids = itertools.count()
        self.target_info = TargetInfo(self.model_config.vocab_size, self.tokenizer, self.device, self.dtype,
                                      self.kv_capacity_tokens, config.max_num_seqs, config.seed, self.model)
        self.pool = ProposerPool(config, self.target_info, self.runner)
        self.pool.load()

    def _make_runner(self) -> ModelRunner:
        config = self.config
        if config.cpu_weight_prepack:
            prepack_linears(self.model)
        num_blocks = self._size_kv_pool(self.model_config)
        graphs = None
        if self.device.type == "cuda" and not config.enforce_eager:
            graphs = GraphLimits(config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len)
        return ModelRunner(self.model, self.model_config, num_blocks, config.block_size, self.device,
                           config.attention_backend, graphs,
                           compile_decode=not config.enforce_eager and self.device.type == "cpu")

    def _size_kv_pool(self, rank_config) -> int:
        """The KV blocks the configured memory holds (of one rank's KV heads: rank_config); sets max_model_len."""
        config, mc = self.config, self.model_config
        num_blocks, per_block = num_kv_blocks(rank_config, config.block_size, self.model.dtype,
                                              config.kv_cache_memory, self.device,
                                              config.kv_cache_default_fraction(self.device, self._ranks_per_host))
        self.kv_capacity_tokens = capacity = num_blocks * config.block_size
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings,
                                 capacity)
        log.info("model %s (%s, %d layers) on %s in %s; linear layers: %s; KV cache: %d blocks x %d tokens = %d "
                 "tokens (%.1f MiB); max_model_len %d", config.model, mc.architecture, mc.num_layers, self.device,
                 self.dtype, linear_kernels(self.model), num_blocks, config.block_size, capacity,
                 num_blocks * per_block / 2**20, self.max_model_len)
        return num_blocks

    def update_speculation(self, **settings) -> None:
        """Change how this engine speculates (any of runtime.config.SPECULATION_ARGS: the speculator, its
        draft size, tree width, adaptivity, a speculator's own settings) while it is idle.
        The proposers are rebuilt; on a bad setting, ValueError and nothing changes."""
        unknown = set(settings) - set(SPECULATION_ARGS)
        if unknown:
            raise ValueError(f"not speculation settings: {', '.join(sorted(unknown))}")
        if self.has_unfinished:
            raise ValueError("the engine has unfinished requests; change speculation when it is idle")
        new_config = dataclasses.replace(self.config, **settings)  # validated by EngineConfig
        self.pool = self.pool.rebuilt(new_config)
        self.config = new_config

    # ---- requests -----------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> list[int]:
        return tokenize(self.tokenizer, prompt, self.model_config.vocab_size)

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
        """ValueError when the request asks for what this engine cannot do (beyond SamplingParams' checks)."""
        if params.speculator not in (None, "none"):
            self.pool.get(params.speculator)
        if params.guided is not None:
            self.grammars.compile(params.guided)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; raise ValueError before anything is scheduled."""
        params = params or SamplingParams()
        token_ids = self.prompt_token_ids(prompt)
        self.check_params(params)
        if params.n != 1:  # as LLM.generate and the server do
            raise ValueError(f"n={params.n}: an engine request is one completion; add one for each of params.choices()")
        request_id = f"req-{next(self._request_ids)}" if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, token_ids, params, tuple(self.model_config.eos_token_ids),
                       speculator=params.speculator or self.config.speculator,
                       constraint=self.grammars.constraint(params.guided) if params.guided else None)
        if self.pool.needs_features(seq.speculator):
            seq.reads_prefix_cache = False  # the proposer needs the target's features of every token
        self.requests[request_id] = RequestState(seq, logprobs=None if params.logprobs is None else [])
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> bool:
        state = self.requests.get(request_id)
        if state is None or state.seq.is_finished:
            return False
        self._finish(state.seq, "abort")
        return True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def check_health(self) -> None:
        """Raise if the target cannot run any more (a tensor-parallel rank failed)."""
        self.runner.check_health()

    def close(self) -> None:
        """Stop the proposers' workers (the draft model's thread) and the target's ranks."""
        try:
            self.pool.close()
        finally:
            self.runner.close()

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        self.pool.propose(self.scheduler.running, self.max_model_len)
        batch = self.scheduler.schedule()
        self.stats.record_schedule(batch)
        if batch.is_empty:
            return []
        layout = VerifyLayout.of(batch)
        masks = StepMasks.of(layout, self.device)  # grammar masks (filled while a GPU target runs)
        logits, hidden, verify_span = self._verify(layout)
        verdicts = self.sampler.verify(logits, layout, masks)
        logprobs = layout_logprobs(layout, verdicts, logits)
        self.pool.keep_target_outputs(layout, verdicts, logits, hidden)
        outputs = self._commit(layout, verdicts, logprobs)
        self._record_step(layout, start, *verify_span)
        return outputs

    def _verify(self, layout: VerifyLayout) -> tuple:
        """One target pass over the layout's tokens, proposers drafting ahead meanwhile:
        logits [R, V], hidden states ([T, H'] when proposers read features, [R, H'] when
        they read hidden states, else None), and (start, end) of the pass."""
        want_hidden = self.pool.hidden_for(layout)
        drafting_ahead = self.pool.draft_ahead(layout)
        verify_start = time.perf_counter()
        try:
            out = self.runner.execute(layout.seqs, layout.num_new_tokens, layout.samples, layout.trees,
                                      return_hidden=want_hidden)
        finally:
            verify_end = time.perf_counter()
            for done in drafting_ahead:
                done.set()
        logits, hidden = out if want_hidden else (out, None)
        return logits, hidden, (verify_start, verify_end)

    def _record_step(self, layout: VerifyLayout, start: float, verify_start: float, verify_end: float) -> None:
        end = time.perf_counter()
        self.stats.record_timing(StepTiming(end - start, self.pool.busy_between(start, end), verify_end - verify_start,
                                            self.pool.busy_between(verify_start, verify_end)))
        if not layout.is_prefill:
            self.pool.controller.observe_step(sum(layout.num_new_tokens) + sum(map(len, layout.trees)),
                                              end - self.pool.proposed_at, has_drafts=any(map(len, layout.trees)))

    def _commit(self, layout: VerifyLayout, verdicts: list[Verdict], logprobs: dict) -> list[RequestOutput]:
        """Advance every sequence past what it ran and kept: the accepted path's KV moved to
        its place, blocks past it released, tokens appended, proposers told."""
        self.stats.num_steps += 1
        self.stats.num_target_tokens += sum(layout.num_new_tokens) + sum(map(len, layout.trees))
        verdict_of = dict(zip(layout.sampled, verdicts))
        src_slots: list[int] = []
        dst_slots: list[int] = []
        outputs = []
        for i, (seq, n, tree) in enumerate(zip(layout.seqs, layout.num_new_tokens, layout.trees)):
            seq.draft_tree = None
            seq.metrics.num_target_forwards += 1
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.stats.num_prompt_tokens_computed += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens += n
            verdict = verdict_of.get(i)
            if verdict is None:  # a prefill chunk short of the prompt's end
                self.block_manager.commit(seq)
                continue
            if len(tree):
                self._accept_path(seq, tree, verdict, src_slots, dst_slots)
            outputs.append(self._emit(seq, verdict, logprobs.get(seq.request_id)))
            if not seq.is_finished:
                self.block_manager.truncate(seq, seq.num_computed_tokens)
                self.block_manager.commit(seq)
                if len(tree):
                    self.pool.tell(seq, "on_accepted", seq.request_id, seq.token_ids, len(verdict.accepted_nodes))
        self.runner.commit_accepted(src_slots, dst_slots)
        return outputs

    def _accept_path(self, seq: Sequence, tree, verdict: Verdict, src_slots: list[int], dst_slots: list[int]) -> None:
        """Queue the KV moves that put the accepted nodes right after the root; count the verification."""
        root = seq.num_computed_tokens - 1  # the root's position; node i was written at root + 1 + i
        for depth, node in enumerate(verdict.accepted_nodes, start=1):
            if node != depth - 1:
                src_slots.append(self.block_manager.slot(seq, root + 1 + node))
                dst_slots.append(self.block_manager.slot(seq, root + depth))
        num_accepted = len(verdict.accepted_nodes)
        seq.num_computed_tokens += num_accepted
        seq.metrics.record_verification(len(tree), num_accepted)
        self.pool.observe_verdict(seq, tree, verdict)
        self.stats.record_verification(len(tree), num_accepted, bonus=verdict.kind == "bonus")

    def _emit(self, seq: Sequence, verdict: Verdict, logprobs: list[TokenLogprobs] | None) -> RequestOutput:
        """Append the verdict's tokens; finish the request when a stop condition holds; a
        failure here fails this request alone."""
        state = self.requests[seq.request_id]
        try:
            output = self.outputs.append(state, verdict.token_ids, logprobs)
        except Exception as e:
            log.exception("request %s failed", seq.request_id)
            output = self.outputs.failed(state, seq, e)
        self.stats.num_generated_tokens += len(output.new_token_ids)
        if output.finished:
            self._finish(seq, output.finish_reason)
        return output

    def _finish(self, seq: Sequence, reason: str) -> None:
        """seq ends (its blocks come back); its proposer and the controller forget it."""
        self.requests.pop(seq.request_id, None)
        if not seq.is_finished:
            self.scheduler.finish(seq, reason)
            self.pool.release(seq)
        if reason != "abort":
            self.stats.num_finished += 1
