"""Attention over the paged KV cache for a ragged batch: the one call behind prefill,
decode and tree verification.

Each sequence in a step brings `query_len` new tokens (already at their positions in
the cache once written) and sees `seq_len` tokens in all (cached context + new). By
default a new token sees everything before it (causal); a sequence may instead give a
boolean mask [query_len, seq_len] (True = may attend), which is how token trees are
verified. The reference backend below is plain PyTorch (gather the blocks, then
scaled_dot_product_attention with the mask) and runs on CPU and CUDA; it is also the
oracle for faster backends.

Grouped-query attention without copying K/V: the G query heads that share one KV head
are folded into the query-length axis, so q is [B, Hkv, G*Q, D] against k [B, Hkv, L, D].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from target_gpu.kv_cache import KVCache

# Sequences with at most this many new tokens are padded into one batched call;
# longer ones (prefill chunks) get a call each, so padding never costs much.
MAX_BATCHED_QUERY_LEN = 16


@dataclass(slots=True)
class SeqAttentionInput:
    query_start: int  # offset of this sequence's first new token in the flat batch
    query_len: int
    seq_len: int  # cached context + new tokens
    block_table: list[int]
    mask: torch.Tensor | None = None  # bool [query_len, seq_len]; None = causal


@dataclass(slots=True)
class AttentionGroup:
    """Sequences attended in one SDPA call, padded to the same query and key lengths."""

    block_tables: torch.Tensor  # [B, num_blocks] (long)
    key_len: int  # L: max seq_len in the group
    query_index: torch.Tensor | None  # [B * Qmax] rows of the flat batch (padding -> 0); None = rows 0..B*Qmax-1
    valid_rows: torch.Tensor | None  # [B * Qmax] bool, None when no padding
    attn_mask: torch.Tensor  # [B, 1, G * Qmax, L] bool
    query_len: int  # Qmax


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot of every new token
    groups: list[AttentionGroup]
    num_tokens: int

    @classmethod
    def build(cls, seqs: list[SeqAttentionInput], slot_mapping: torch.Tensor, block_size: int,
              num_queries_per_kv: int, device: torch.device) -> "AttentionMetadata":
        short = [s for s in seqs if s.query_len <= MAX_BATCHED_QUERY_LEN]
        groups = [_build_group(g, block_size, num_queries_per_kv, device)
                  for g in ([short] if short else []) + [[s] for s in seqs if s.query_len > MAX_BATCHED_QUERY_LEN]]
        return cls(slot_mapping, groups, sum(s.query_len for s in seqs))


def _build_group(seqs: list[SeqAttentionInput], block_size: int, g: int, device) -> AttentionGroup:
    b = len(seqs)
    q_max = max(s.query_len for s in seqs)
    key_len = max(s.seq_len for s in seqs)
    num_blocks = -(-key_len // block_size)
    tables = torch.zeros(b, num_blocks, dtype=torch.long)
    mask = torch.zeros(b, q_max, key_len, dtype=torch.bool)
    query_index = torch.zeros(b, q_max, dtype=torch.long)
    valid = torch.zeros(b, q_max, dtype=torch.bool)
    for i, s in enumerate(seqs):
        nb = -(-s.seq_len // block_size)
        tables[i, :nb] = torch.tensor(s.block_table[:nb], dtype=torch.long)
        query_index[i, :s.query_len] = torch.arange(s.query_start, s.query_start + s.query_len)
        valid[i, :s.query_len] = True
        if s.mask is None:  # causal: new token j sits at position seq_len - query_len + j
            context = s.seq_len - s.query_len
            mask[i, :s.query_len, :s.seq_len] = torch.ones(s.query_len, s.seq_len, dtype=torch.bool).tril(context)
        else:
            assert s.mask.shape == (s.query_len, s.seq_len), (s.mask.shape, s.query_len, s.seq_len)
            mask[i, :s.query_len, :s.seq_len] = s.mask
        mask[i, s.query_len:, 0] = True  # padded rows attend somewhere, so softmax stays finite
    # [B, Q, L] -> [B, 1, G*Q, L]: the same mask for each of the G query heads of a KV head
    attn_mask = mask.unsqueeze(1).expand(b, g, q_max, key_len).reshape(b, 1, g * q_max, key_len)
    all_valid = bool(valid.all())
    query_index = query_index.flatten()
    in_order = all_valid and seqs[0].query_start == 0 and bool((query_index == torch.arange(len(query_index))).all())
    return AttentionGroup(
        block_tables=tables.to(device),
        key_len=key_len,
        query_index=None if in_order else query_index.to(device),
        valid_rows=None if all_valid else valid.flatten().to(device),
        attn_mask=attn_mask.to(device),
        query_len=q_max,
    )


class TorchAttentionBackend:
    """Reference paged attention in plain PyTorch (CPU and CUDA)."""

    name = "torch"

    def __init__(self, kv_cache: KVCache):
        self.kv_cache = kv_cache

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # q [T, Hq, D]; k, v [T, Hkv, D] -> out [T, Hq, D]
        k_cache, v_cache = self.kv_cache.k[layer_idx], self.kv_cache.v[layer_idx]
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
        if len(meta.groups) == 1 and meta.groups[0].query_index is None:
            return _attend_group(q, k_cache, v_cache, meta.groups[0])
        out = torch.empty_like(q)
        for group in meta.groups:
            rows = _attend_group(q, k_cache, v_cache, group)  # [B*Qmax, Hq, D]
            index = group.query_index
            if index is None:
                index = torch.arange(rows.shape[0], device=q.device)
            if group.valid_rows is not None:
                rows, index = rows[group.valid_rows], index[group.valid_rows]
            out.index_copy_(0, index, rows)
        return out


def _attend_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  group: AttentionGroup) -> torch.Tensor:
    b, q_len, key_len = group.block_tables.shape[0], group.query_len, group.key_len
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    g = num_heads // num_kv_heads
    # gather blocks: [B, nb, bs, Hkv, D] -> [B, Hkv, L, D]
    keys = k_cache[group.block_tables].flatten(1, 2)[:, :key_len].transpose(1, 2)
    values = v_cache[group.block_tables].flatten(1, 2)[:, :key_len].transpose(1, 2)
    # [B*Q, Hq, D] -> [B, Q, Hkv, G, D] -> [B, Hkv, G*Q, D]
    q = q.narrow(0, 0, b * q_len) if group.query_index is None else q.index_select(0, group.query_index)
    queries = q.reshape(b, q_len, num_kv_heads, g, head_dim)
    queries = queries.permute(0, 2, 3, 1, 4).reshape(b, num_kv_heads, g * q_len, head_dim)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.attn_mask)
    # [B, Hkv, G*Q, D] -> [B, Q, Hkv, G, D] -> [B*Q, Hq, D]
    out = out.view(b, num_kv_heads, g, q_len, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(b * q_len, num_heads, head_dim)
