"""Runs the target model for one scheduled step over the paged KV cache.

Input: the step's sequences, how many of their own new tokens each brings, which ones
need logits (those whose new tokens reach the end of what they have; a prefill chunk in
the middle of a prompt needs none), and a draft tree per sequence (empty when plain).

A decoding sequence with a tree of n nodes runs 1 + n tokens: its last committed token
(the root) at position L-1, node i at position L-1 + depth(i), each attending to the
whole committed context and to its tree ancestors only (the tree mask). Their KV goes to
the sequence's next 1 + n slots in node order, and logits come back for all 1 + n rows.
After acceptance, `commit_accepted` moves the accepted path's KV to consecutive slots;
what is beyond is simply not counted as computed any more (the block manager releases
the blocks). Output: logits [R, V] (float32) for the rows asked for, in order. The
runner neither schedules nor samples. Attention goes through a backend chosen by name:
the PyTorch reference (target_gpu.attention) or Triton kernels (target_gpu.triton_attention).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from target_gpu.attention import ATTENTION_BACKENDS
from runtime.models.config import ModelConfig
from runtime.models.decoder import DecoderModel
from target_gpu.attention import AttentionMetadata, SeqAttentionInput, TorchAttentionBackend
from target_gpu.compiled_decode import CompiledDecodeStep
from target_gpu.cuda_graphs import CudaGraphRunner
from target_gpu.kv_cache import KVCache

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GraphLimits:
    """The steps CUDA graphs are captured for: at most max_tokens tokens (decoding tokens
    plus draft nodes) of at most max_seqs sequences of at most max_model_len tokens.
    capture=False runs the same padded steps eagerly (for tests without a GPU)."""

    max_tokens: int
    max_seqs: int
    max_model_len: int
    capture: bool = True


def make_attention_backend(name: str, kv_cache: KVCache, device: torch.device, window: int | None = None):
    """'auto' | 'torch' | 'triton' -> a backend over kv_cache. auto: Triton on CUDA when it
    can run there, else the PyTorch reference. ValueError when Triton is asked for and
    cannot run (no triton, no CUDA and no interpreter, an unsupported head_dim). window: the
    model's sliding window (None: none)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend(kv_cache)
    from target_gpu.triton_attention import TritonAttentionBackend, unsupported_reason  # imports triton
    if name == "auto" and (reason := unsupported_reason(kv_cache)):
        log.warning("attention: the Triton backend cannot run (%s); using the PyTorch reference", reason)
        return TorchAttentionBackend(kv_cache)
    return TritonAttentionBackend(kv_cache, window)


COMPILED_VERIFY_KEYS = 1 << 16  # a verify step's tokens x their longest sequence, at most, for the compiled step


@dataclass(slots=True)
class StepInput:
    """One target pass, as plain data (what tensor-parallel ranks receive)."""

    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    slots: list[int]  # [T] KV cache slot of each token
    attn_inputs: list[SeqAttentionInput]  # per sequence: its rows, context length, block table, tree mask
    logits_rows: list[int]  # [R] the rows whose logits are wanted


class ModelRunner:
    def __init__(self, model: DecoderModel, config: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device, attention_backend: str = "torch", graphs: GraphLimits | None = None,
                 compile_decode: bool = False):
        """num_blocks: the blocks the block manager hands out; the cache holds one more, the
        scratch block that padded tokens of a CUDA graph write into. graphs: capture CUDA
        graphs for decode/verify steps within these limits (CUDA and the Triton backend only).
        compile_decode: plain decode steps run as one compiled graph (compiled_decode), compiled
        here."""
        self.model = model
        self.config = config
        self.device = device
        self.num_blocks, self.block_size = num_blocks, block_size
        self.kv_cache = KVCache(config, num_blocks + 1, block_size, model.dtype, device)
        self.attention = make_attention_backend(attention_backend, self.kv_cache, device, config.sliding_window)
        self.feature_layers: tuple[int, ...] = ()
        self.graph_limits = graphs if graphs is not None and self.attention.needs_kernel_metadata else None
        self.graphs = None
        self.compile_decode = compile_decode
        self.compiled_decode: CompiledDecodeStep | None = None
        self._make_graphs()

    def _make_graphs(self) -> None:
        if self.compile_decode:
            self.compiled_decode = CompiledDecodeStep(self.model, self.kv_cache, self.feature_layers)
            log.info("compiling the decode step (Inductor caches it: minutes the first time on a machine, "
                     "less after)")
            seconds = self.compiled_decode.warm_up(self.kv_cache.num_blocks - 1, self.device)
            log.info("decode step compiled in %.1f s", seconds)
        limits = self.graph_limits
        if limits is not None:
            self.graphs = None  # the old graphs' memory goes back before the new ones are captured
            self.graphs = CudaGraphRunner(self.model, self.attention, self.kv_cache, limits.max_tokens,
                                          limits.max_seqs, limits.max_model_len,
                                          scratch_slot=(self.kv_cache.num_blocks - 1) * self.block_size,
                                          capture=limits.capture, feature_layers=self.feature_layers)

    def set_feature_layers(self, layers: tuple[int, ...]) -> None:
        """From now on, hidden states carry the residual stream entering these layers after
        the final hidden state (EAGLE-3's features; DecoderModel.forward). CUDA graphs are
        captured again when the set changes."""
        layers = tuple(sorted(set(layers)))
        bad = [j for j in layers if not 0 <= j < self.config.num_layers]
        if bad:
            raise ValueError(f"feature layers {bad} are out of range for a {self.config.num_layers}-layer target")
        if layers != self.feature_layers:
            self.feature_layers = layers
            self._make_graphs()

    def prepare(self, seqs, num_new_tokens: list[int], needs_logits: list[bool], trees=None) -> StepInput:
        """The step's tokens, positions, KV slots and attention inputs: each sequence's new
        tokens, then its tree nodes (a tree's root at position L-1, node i at L-1 + depth(i))."""
        step = StepInput([], [], [], [], [])
        bs = self.block_size
        for i, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
            start = seq.num_computed_tokens
            table = seq.block_table
            tree = trees[i] if trees is not None else None
            num_nodes = len(tree) if tree is not None else 0
            first_row = len(step.input_ids)
            step.input_ids.extend(seq.token_ids[start:start + n])
            step.positions.extend(range(start, start + n))
            mask = None
            if num_nodes:
                assert n == 1 and needs_logits[i], "a draft tree hangs below one decoding token"
                step.input_ids.extend(tree.token_ids)
                step.positions.extend(start + depth for depth in tree.depths)
                mask = tree.attention_mask()  # [Q, Q] over the new tokens; the context is everyone's
            total = n + num_nodes
            step.slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + total))
            step.attn_inputs.append(SeqAttentionInput(first_row, total, start + total, table, mask))
            if needs_logits[i]:
                step.logits_rows.extend(range(first_row + n - 1, first_row + total))
        return step

    @torch.inference_mode()
    def execute(self, seqs, num_new_tokens: list[int], needs_logits: list[bool], trees=None,
                return_hidden: bool | str = False):
        """Run the new tokens (and draft nodes) of `seqs`; return logits [R, V] for the rows
        asked for: the last new token when plain, the root and every node with a tree.
        With return_hidden: (logits [R, V], hidden states [R, H'] of those rows); with
        return_hidden="all": (logits [R, V], hidden states [T, H'] of every token run, in
        input order: each sequence's new tokens, then its tree nodes). H' = H, the final
        hidden states, or with feature layers (1 + k) H: those, then the k layers' inputs."""
        step = self.prepare(seqs, num_new_tokens, needs_logits, trees)
        if self._runs_compiled(step, num_new_tokens):  # every token a logits row: hidden [T, H'] is "all" too
            logits, hidden = self.compiled_decode(step, self.device, self.block_size)
            return (logits, hidden) if return_hidden else logits
        return self.run(step, return_hidden)

    def _runs_compiled(self, step: StepInput, num_new_tokens: list[int]) -> bool:
        """A decode step (one new token a sequence), or a verify step (trees below them)
        whose tokens read at most COMPILED_VERIFY_KEYS cached keys in all: each token of the
        compiled step gathers its context on its own (compiled_decode)."""
        if self.compiled_decode is None or any(n != 1 for n in num_new_tokens) \
                or len(step.logits_rows) != len(step.input_ids):
            return False
        tokens = len(step.input_ids)
        return tokens == len(num_new_tokens) or tokens * max(a.seq_len for a in step.attn_inputs) \
            <= COMPILED_VERIFY_KEYS

    @torch.inference_mode()
    def run(self, step: StepInput, return_hidden: bool | str = False):
        """Run a prepared step (execute's outputs)."""
        if self.graphs is not None and len(step.logits_rows) == len(step.input_ids) \
                and self.graphs.can_run(step.attn_inputs, len(step.input_ids)):
            # a pure decode/verify step: every row wants logits, in order
            all_hidden, logits = self.graphs.run(step.input_ids, step.positions, step.slots, step.attn_inputs)
            if return_hidden:
                return logits, all_hidden
            return logits
        device = self.device
        ids = torch.tensor(step.input_ids, dtype=torch.long, device=device)
        pos = torch.tensor(step.positions, dtype=torch.long, device=device)
        backend = self.attention
        meta = AttentionMetadata.build(step.attn_inputs, torch.tensor(step.slots, dtype=torch.long, device=device),
                                       self.block_size, self.config.num_heads // self.config.num_kv_heads, device,
                                       for_kernel=backend.needs_kernel_metadata, window=self.config.sliding_window)

        def attention(layer_idx, q, k, v):
            return backend.forward(layer_idx, q, k, v, meta)

        all_hidden = self.model(ids, pos, attention, self.feature_layers)  # [T, H']
        rows = torch.tensor(step.logits_rows, dtype=torch.long, device=device)
        hidden = all_hidden.index_select(0, rows)  # [R, H']
        logits = self.model.compute_logits(hidden[:, :self.config.hidden_size])  # [R, V]
        if return_hidden == "all":
            return logits, all_hidden
        return (logits, hidden) if return_hidden else logits

    def check_health(self) -> None:
        """Nothing can fail outside this process (TPRunner's ranks can)."""

    def close(self) -> None:
        """Nothing to stop in this process (TPRunner stops its ranks)."""

    @torch.inference_mode()
    def commit_accepted(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Move accepted draft tokens' KV to where their positions say (no-op when empty)."""
        if src_slots:
            self.kv_cache.copy_slots(torch.tensor(src_slots, device=self.device),
                                     torch.tensor(dst_slots, device=self.device))
