"""Context parallelism: long prompt chunks prefilled by C ranks at once with ring attention
(target_gpu.ring_attention), decoding as usual in the ranks of the first one.

The ranks form a mesh of C context-parallel x T tensor-parallel ranks (target_gpu.tp_launch,
RankGroups: rank = c * T + t). Every rank holds its tensor-parallel shard t of the model (the
whole model when T = 1). Ranks 0..T-1 (c = 0) hold the paged KV cache, each its shard of the
KV heads, and run every step as the tensor-parallel ranks do (target_gpu.tensor_parallel);
rank 0 is the engine's process. The other ranks (worker processes, started and watched as
the tensor-parallel ranks are) hold no KV cache: they only join ring chunks.

When a step holds a prompt chunk of at least `min_tokens` tokens (--cp-min-tokens) with no
draft tree, rank 0 sends the chunk to every rank, and each ring (the C ranks of one t, on
that shard's heads) runs it:
  1. the ring's first rank broadcasts the K/V of the prompt before the chunk that the chunk
     still sees, read from its paged cache (a chunk after the first attends to it);
  2. every rank runs its zig-zag slice of the chunk, K/V passing around the ring inside
     every layer (and the shards' all-reduces within each c, as always);
  3. the ring's first rank gathers every rank's K/V of its slice and writes them into the
     sequence's slots, so the next chunks and decoding read the cache as if it had run the
     chunk alone;
  4. ranks 0..T-1 take the logits of the chunk's last token, which their slices hold.
The other sequences of the step run as usual, in the same step. Chunks that need every
token's hidden states (EAGLE's features) run as usual too.

Limits: one node, on a CPU (gloo). Between ring chunks ranks c > 0 idle.
"""
from __future__ import annotations

import logging
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from target_gpu.ring_attention import ring_prefill, window_start
from target_gpu.tensor_parallel import TPRunner
from target_gpu.tp_launch import RankGroups, TPLaunch

log = logging.getLogger(__name__)


class RingChunk(NamedTuple):
    """One chunk the ring ran, as rank 0 saw it."""

    start: int  # its first position
    tokens: int
    seconds: float  # the whole chunk on rank 0, into the cache
    ring_wait_s: float  # waiting for K/V blocks in the ring (what attention did not hide)
    exchange_s: float  # the earlier context's broadcast and the K/V gather (which waits for the slowest rank)


def _stacked_kv(attention, num_layers: int, block_len: int) -> torch.Tensor:
    """A rank's K/V of its slice, every layer, padded to block_len: [layers, 2, block_len, Hkv, D]."""
    k0 = attention.kv[0][0]
    out = k0.new_zeros(num_layers, 2, block_len, *k0.shape[1:])
    for layer in range(num_layers):
        k, v = attention.kv[layer]
        out[layer, 0, :k.shape[0]], out[layer, 1, :v.shape[0]] = k, v
    return out


class RingMember:
    """One rank's part of every ring chunk (the module docstring). `runner`: the ModelRunner
    whose KV cache the ring's first rank reads the earlier context from and writes the chunk
    into; None on the other ranks."""

    def __init__(self, model, config, groups: RankGroups, ring_size: int, runner=None):
        """config: this rank's shapes (its shard's heads)."""
        self.model, self.config, self.groups, self.ring_size, self.runner = model, config, groups, ring_size, runner
        self.window = config.sliding_window
        self.root = groups.ring_ranks[0]

    def chunk(self, token_ids: list[int], start: int, block_table: list[int]) -> tuple[torch.Tensor, float, float]:
        """Prefill the chunk token_ids at positions start.. with the ring: (final hidden states
        of this rank's slice [T, H], seconds waiting in the ring, seconds in the context's
        broadcast and the K/V gather). The ring's first rank's slice ends with the chunk's last token."""
        n, ring = len(token_ids), self.groups.ring
        seen = window_start(start, self.window)
        slots = self._slots(block_table, start + n) if self.runner is not None else None
        exchange = time.perf_counter()
        prefix = self._context(slots[seen:start] if slots is not None else None, start - seen) if start else None
        exchange = time.perf_counter() - exchange
        hidden, slices, attention = ring_prefill(self.model, torch.tensor(token_ids), self.groups.cp_index,
                                                 self.ring_size, list(self.groups.ring_ranks), ring, start, prefix)
        mine = _stacked_kv(attention, self.config.num_layers, attention.block_len)
        gathered = [torch.empty_like(mine) for _ in range(self.ring_size)] if slots is not None else None
        gather_start = time.perf_counter()
        dist.gather(mine, gathered, dst=self.root, group=ring)
        exchange += time.perf_counter() - gather_start
        if slots is not None:
            self._write(gathered, slots[start + torch.cat(slices)], [len(s) for s in slices])
        return hidden, attention.comm_s, exchange

    def _slots(self, block_table: list[int], length: int) -> torch.Tensor:
        """The cache slots of positions 0..length-1 [length]."""
        bs = self.runner.block_size
        positions = torch.arange(length)
        return torch.tensor(block_table, dtype=torch.long)[positions // bs] * bs + positions % bs

    def _context(self, slots: torch.Tensor | None, length: int) -> torch.Tensor:
        """The K/V of the context the chunk sees [layers, 2, length, Hkv, D], read from the
        cache at `slots` by the ring's first rank and broadcast to the others."""
        if slots is not None:
            cache = self.runner.kv_cache
            prefix = torch.stack([torch.stack([k.flatten(0, 1)[slots], v.flatten(0, 1)[slots]])
                                  for k, v in zip(cache.k, cache.v)])
        else:
            cfg = self.config
            prefix = torch.empty(cfg.num_layers, 2, length, cfg.num_kv_heads, cfg.head_dim, dtype=self.model.dtype)
        dist.broadcast(prefix, self.root, group=self.groups.ring)
        return prefix

    def _write(self, gathered: list[torch.Tensor], slots: torch.Tensor, sizes: list[int]) -> None:
        """Every rank's K/V (gathered[r] [layers, 2, block_len, Hkv, D], its first sizes[r]
        rows real) into the cache at slots [sum(sizes)], in rank order."""
        kv = torch.cat([part[:, :, :size] for part, size in zip(gathered, sizes)], dim=2)  # [layers, 2, L, Hkv, D]
        cache = self.runner.kv_cache
        for layer in range(len(cache.k)):
            cache.k[layer].flatten(0, 1)[slots] = kv[layer, 0]
            cache.v[layer].flatten(0, 1)[slots] = kv[layer, 1]


class RingWorker:
    """A worker rank's commands: ring chunks, and the steps the ranks that decode run
    (`runner`, a ModelRunner; None on ranks c > 0, which let those pass)."""

    def __init__(self, member: RingMember, runner=None):
        self.member, self.runner = member, runner

    @torch.inference_mode()
    def ring(self, token_ids: list[int], start: int, block_table: list[int], needs_logits: bool) -> None:
        hidden = self.member.chunk(token_ids, start, block_table)[0]
        if needs_logits and self.runner is not None:  # the vocab-parallel head's gather, with rank 0
            self.member.model.compute_logits(hidden[-1:])

    def run(self, step, return_hidden) -> None:
        if self.runner is not None:
            self.runner.run(step, return_hidden)

    def commit_accepted(self, src_slots: list[int], dst_slots: list[int]) -> None:
        if self.runner is not None:
            self.runner.commit_accepted(src_slots, dst_slots)

    def set_feature_layers(self, layers: tuple[int, ...]) -> None:
        if self.runner is not None:
            self.runner.set_feature_layers(layers)


class CPRunner(TPRunner):
    """ModelRunner's interface over a mesh of C x T ranks; this process is rank 0 and holds
    shard 0 of the model and of the KV cache (the module docstring)."""

    kind = "context-parallel"

    def __init__(self, model, model_path: str, dtype: str, quantization: str, launch: TPLaunch, *args,
                 min_tokens: int = 2048, **kwargs):
        super().__init__(model, model_path, dtype, quantization, launch, *args, **kwargs)
        self.min_tokens = min_tokens
        self.member = RingMember(self.runner.model, self.config, self.groups, launch.context_parallel_size, self.runner)
        self.ring_chunks: list[RingChunk] = []

    def _pins_rank0(self, launch: TPLaunch) -> bool:
        """Rank 0 decoding alone between ring chunks keeps every core; with T > 1 it decodes
        with its tensor-parallel peers, and takes its share."""
        return launch.tensor_parallel_size > 1

    def _rings(self, seq, n: int, tree, return_hidden) -> bool:
        return (n >= self.min_tokens and not (tree is not None and len(tree)) and return_hidden != "all"
                and not self.runner.feature_layers and seq.num_computed_tokens + n <= seq.num_prompt_tokens)

    @torch.inference_mode()
    def execute(self, seqs, num_new_tokens, needs_logits, trees=None, return_hidden=False):
        trees = trees if trees is not None else [None] * len(seqs)
        ring = [self._rings(*args, return_hidden) for args in zip(seqs, num_new_tokens, trees)]
        if not any(ring):
            return self._decode_ranks_execute(seqs, num_new_tokens, needs_logits, trees, return_hidden)
        rest = [i for i, r in enumerate(ring) if not r]
        outputs = self._decode_ranks_execute(*([x[i] for i in rest] for x in (seqs, num_new_tokens, needs_logits,
                                                                               trees)), return_hidden) if rest else None
        logits, hidden = (outputs if return_hidden else (outputs, None)) if outputs is not None else (None, None)
        parts_logits, parts_hidden, row = [], [], 0
        for i, seq in enumerate(seqs):
            if ring[i]:
                chunk_logits, last = self._ring_chunk(seq, num_new_tokens[i], needs_logits[i])  # [1, V], [1, H]
                if needs_logits[i]:
                    parts_logits.append(chunk_logits)
                    parts_hidden.append(last)
            elif needs_logits[i]:
                rows = 1 + (len(trees[i]) if trees[i] is not None else 0)
                parts_logits.append(logits[row:row + rows])
                parts_hidden.append(hidden[row:row + rows] if hidden is not None else None)
                row += rows
        model = self.runner.model
        logits = torch.cat(parts_logits) if parts_logits else torch.empty(0, model.config.vocab_size)
        if not return_hidden:
            return logits
        return logits, (torch.cat(parts_hidden) if parts_hidden else torch.empty(0, model.config.hidden_size))

    def _decode_ranks_execute(self, seqs, num_new_tokens, needs_logits, trees, return_hidden):
        """A step of the ranks that hold the KV cache: rank 0 alone (T = 1), or with its peers."""
        if self.tp_size == 1:
            return self.runner.execute(seqs, num_new_tokens, needs_logits, trees, return_hidden)
        return super().execute(seqs, num_new_tokens, needs_logits, trees, return_hidden)

    @torch.inference_mode()
    def _ring_chunk(self, seq, n: int, needs_logits: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Prefill seq's next n prompt tokens over every rank, their K/V into seq's slots:
        (the logits of the chunk's last token [1, V] when asked for, its final hidden state [1, H])."""
        began = time.perf_counter()
        start = seq.num_computed_tokens
        token_ids = seq.token_ids[start:start + n]
        block_table = seq.block_table[:-(-(start + n) // self.runner.block_size)]
        with self._ranks.command("ring", token_ids, start, block_table, needs_logits):
            hidden, ring_wait, exchange = self.member.chunk(token_ids, start, block_table)
            last = hidden[-1:]  # rank 0's slice ends with the chunk's last token
            logits = self.runner.model.compute_logits(last) if needs_logits else None
        self.ring_chunks.append(RingChunk(start, n, time.perf_counter() - began, ring_wait, exchange))
        return logits, last

    def commit_accepted(self, src_slots: list[int], dst_slots: list[int]) -> None:
        if self.tp_size > 1:
            super().commit_accepted(src_slots, dst_slots)
        else:  # the KV cache is rank 0's alone
            self.runner.commit_accepted(src_slots, dst_slots)

    def set_feature_layers(self, layers: tuple[int, ...]) -> None:
        if self.tp_size > 1:
            super().set_feature_layers(layers)
        else:
            self.runner.set_feature_layers(layers)
