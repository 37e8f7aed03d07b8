"""Context parallelism: long prompt chunks prefilled by N ranks at once with ring attention
(target_gpu.ring_attention), decoding as usual in rank 0.

Rank 0 is the engine's process: it holds the model and the paged KV cache, and runs every
step as a ModelRunner would. Ranks 1..N-1 (worker processes, started and watched as the
tensor-parallel ranks are: target_gpu.tp_launch, target_gpu.tensor_parallel) hold a whole
replica of the model and no KV cache. When a step holds a prompt chunk of at least
`min_tokens` tokens (--cp-min-tokens) with no draft tree, rank 0 sends the chunk to every
rank and:
  1. broadcasts the K/V of the prompt before the chunk, read from its paged cache (a chunk
     after the first attends to it);
  2. runs its zig-zag slice of the chunk while the other ranks run theirs, K/V passing around
     the ring inside every layer;
  3. gathers every rank's K/V of its slice and writes them into the sequence's slots, so the
     next chunks and decoding read the cache as if rank 0 had run the chunk alone;
  4. takes the logits of the chunk's last token, which its own slice holds.
The other sequences of the step run as usual, in the same step. Chunks that need every
token's hidden states (EAGLE's features) run as usual too.

Limits: one node, on a CPU (gloo), and not together with tensor parallelism yet.
"""
from __future__ import annotations

import logging
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from target_gpu.ring_attention import ring_prefill, zigzag_positions
from target_gpu.tensor_parallel import TPRunner

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


class RingWorker:
    """A worker rank's part: its slice of each ring chunk; its K/V then go to rank 0."""

    def __init__(self, model, rank: int, world: int, group):
        self.model, self.rank, self.world, self.group = model, rank, world, group

    @torch.inference_mode()
    def ring(self, token_ids: list[int], start: int) -> None:
        cfg = self.model.config
        prefix = None
        if start:
            prefix = torch.empty(cfg.num_layers, 2, start, cfg.num_kv_heads, cfg.head_dim, dtype=self.model.dtype)
            dist.broadcast(prefix, 0, group=self.group)
        ids = torch.tensor(token_ids, dtype=torch.long)
        _, _, attention = ring_prefill(self.model, ids, self.rank, self.world, group=self.group, start=start,
                                       prefix=prefix)
        dist.gather(_stacked_kv(attention, cfg.num_layers, attention.block_len), None, dst=0, group=self.group)


class CPRunner(TPRunner):
    """ModelRunner's interface over N context-parallel ranks; this process is rank 0 and
    holds the whole model and the KV cache (the module docstring)."""

    kind = "context-parallel"
    pins_rank0 = False  # rank 0 decodes alone between ring chunks: it keeps every core

    def __init__(self, *args, min_tokens: int = 2048, **kwargs):
        super().__init__(*args, **kwargs)
        self.min_tokens = min_tokens
        self.ring_chunks: list[RingChunk] = []

    def _check_split(self, model, world: int) -> None:
        """Every rank holds the whole model: any model goes."""

    def _keep_rank0s_part(self, model, world: int, device, tensors):
        model.to(device)
        return model.config

    def _rings(self, seq, n: int, tree, return_hidden) -> bool:
        return (n >= self.min_tokens and not (tree is not None and len(tree)) and return_hidden != "all"
                and not self.runner.feature_layers and seq.num_computed_tokens + n <= seq.num_prompt_tokens)

    @torch.inference_mode()
    def execute(self, seqs, num_new_tokens, needs_logits, trees=None, return_hidden=False):
        trees = trees if trees is not None else [None] * len(seqs)
        ring = [self._rings(*args, return_hidden) for args in zip(seqs, num_new_tokens, trees)]
        if not any(ring):  # the other ranks have no KV cache: rank 0 runs the step alone
            return self.runner.execute(seqs, num_new_tokens, needs_logits, trees, return_hidden)
        rest = [i for i, r in enumerate(ring) if not r]
        outputs = self.runner.execute(*([x[i] for i in rest] for x in (seqs, num_new_tokens, needs_logits, trees)),
                                      return_hidden=return_hidden) if rest else None
        logits, hidden = (outputs if return_hidden else (outputs, None)) if outputs is not None else (None, None)
        parts_logits, parts_hidden, row = [], [], 0
        for i, seq in enumerate(seqs):
            if ring[i]:
                last = self._ring_chunk(seq, num_new_tokens[i])  # [1, H]
                if needs_logits[i]:
                    parts_logits.append(self.runner.model.compute_logits(last))
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

    @torch.inference_mode()
    def _ring_chunk(self, seq, n: int) -> torch.Tensor:
        """Prefill seq's next n prompt tokens over every rank; their K/V into seq's slots; the
        final hidden state of the chunk's last token [1, H]."""
        began = time.perf_counter()
        start = seq.num_computed_tokens
        token_ids = seq.token_ids[start:start + n]
        cache, bs, world = self.runner.kv_cache, self.runner.block_size, self.world_size
        slots = torch.tensor([seq.block_table[p // bs] * bs + p % bs for p in range(start + n)])
        with self._ranks.command("ring", token_ids, start):
            group = self._ranks.steps
            prefix, exchange = None, time.perf_counter()
            if start:
                prefix = torch.stack([torch.stack([cache.k[layer].flatten(0, 1)[slots[:start]],
                                                   cache.v[layer].flatten(0, 1)[slots[:start]]])
                                      for layer in range(len(cache.k))])  # [layers, 2, start, Hkv, D]
                dist.broadcast(prefix, 0, group=group)
            exchange = time.perf_counter() - exchange
            hidden, _, attention = ring_prefill(self.runner.model, torch.tensor(token_ids), 0, world, group=group,
                                                start=start, prefix=prefix)
            mine = _stacked_kv(attention, len(cache.k), attention.block_len)
            gathered = [torch.empty_like(mine) for _ in range(world)]
            gather_start = time.perf_counter()
            dist.gather(mine, gathered, dst=0, group=group)
            exchange += time.perf_counter() - gather_start
        for rank, kv in enumerate(gathered):  # kv [layers, 2, block_len, Hkv, D]
            positions = zigzag_positions(n, world, rank)
            rank_slots = slots[start + positions]
            for layer in range(len(cache.k)):
                cache.k[layer].flatten(0, 1)[rank_slots] = kv[layer, 0, :len(positions)]
                cache.v[layer].flatten(0, 1)[rank_slots] = kv[layer, 1, :len(positions)]
        self.ring_chunks.append(RingChunk(start, n, time.perf_counter() - began, attention.comm_s, exchange))
        return hidden[-1:]  # rank 0's slice ends with the chunk's last token

    def commit_accepted(self, src_slots: list[int], dst_slots: list[int]) -> None:
        self.runner.commit_accepted(src_slots, dst_slots)  # the KV cache is rank 0's alone

    def set_feature_layers(self, layers: tuple[int, ...]) -> None:
        self.runner.set_feature_layers(layers)
