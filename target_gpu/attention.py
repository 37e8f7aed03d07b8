"""Attention over the paged KV cache for a ragged batch: the one call behind prefill,
decode and tree verification.

Each sequence in a step brings `query_len` new tokens (already at their positions in
the cache once written) and sees `seq_len` tokens in all (cached context + new). By
default a new token sees everything before it (causal); a sequence may instead give a
boolean mask [query_len, M] over its last M keys (True = may attend; every key before
those is seen by all), which is how token trees are verified: M = query_len for the
target's tree (root and nodes), more for a head whose earlier drafts are cached. The reference backend below is plain PyTorch (gather the blocks, then
scaled_dot_product_attention with the mask) and runs on CPU and CUDA; it is also the
oracle for faster backends (target_gpu.triton_attention), which read the same step as
flat per-sequence tensors (KernelMetadata, built only for them).

Grouped-query attention without copying K/V: the G query heads that share one KV head
are folded into the query-length axis, so q is [B, Hkv, G*Q, D] against k [B, Hkv, L, D].
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from target_gpu.kv_cache import KVCache

ATTENTION_BACKENDS = ("auto", "torch", "triton")  # auto: triton on CUDA when it can run there, else torch

# Sequences with at most this many new tokens are padded into one batched call;
# longer ones (prefill chunks) get a call each, so padding never costs much.
MAX_BATCHED_QUERY_LEN = 16


@dataclass(slots=True)
class SeqAttentionInput:
    query_start: int  # offset of this sequence's first new token in the flat batch
    query_len: int
    seq_len: int  # cached context + new tokens
    block_table: list[int]
    mask: torch.Tensor | None = None  # bool [query_len, M] over the last M keys (earlier ones seen); None = causal


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
class KernelMetadata:
    """The step as flat tensors for a fused kernel (target_gpu.triton_attention): one launch
    covers every sequence. A program takes `rows_per_program` // G query rows of one
    sequence for one KV head; the work list names its sequence and first row."""

    query_start: torch.Tensor  # [B] int32: first row of the sequence in the flat batch
    query_len: torch.Tensor  # [B] int32
    seq_len: torch.Tensor  # [B] int32: cached context + new tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    mask_offset: torch.Tensor  # [B] int32: start of the sequence's [Q, Q] new-token mask in masks; -1 = causal
    masks: torch.Tensor  # [sum of Q*Q over masked sequences, or 1] int8: 1 = may attend
    work_seq: torch.Tensor  # [W] int32: the sequence of each program
    work_row: torch.Tensor  # [W] int32: its first query row within the sequence
    rows_per_program: int  # M of the kernel's tile: G * query rows (padded), a power of two >= 16
    max_seq_len: int  # the longest seq_len the step may hold (a CUDA graph's: the model's limit)
    num_splits: int | None = None  # parts of each program's key range; None = the kernel's choice

    @classmethod
    def build(cls, seqs: list[SeqAttentionInput], block_size: int, g: int, device) -> "KernelMetadata":
        rows = _rows_per_program(max((s.query_len for s in seqs), default=1), g)
        fields = KernelFields.of(seqs, block_size, g, rows)
        # every int32 vector in one host-to-device copy: [4, B] per sequence, then [2, W] per program
        ints = torch.cat([fields.per_seq.flatten(), fields.work.flatten()]).to(device)
        b, w = fields.per_seq.shape[1], fields.work.shape[1]
        query_start, query_len, seq_len, mask_offset = ints[:4 * b].view(4, b)
        work_seq, work_row = ints[4 * b:].view(2, w)
        return cls(query_start, query_len, seq_len, fields.block_tables.to(device), mask_offset,
                   fields.masks.to(device), work_seq, work_row, rows, max((s.seq_len for s in seqs), default=0))


@dataclass(slots=True)
class KernelFields:
    """KernelMetadata's contents on the host, before they go to the device (as they are, or
    into the fixed buffers that CUDA graphs read: target_gpu.cuda_graphs)."""

    per_seq: torch.Tensor  # [4, B] int32: query_start, query_len, seq_len, mask_offset
    work: torch.Tensor  # [2, W] int32: work_seq, work_row
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    masks: torch.Tensor  # [sum of Q*Q over masked sequences, or 1] int8

    @classmethod
    def of(cls, seqs: list[SeqAttentionInput], block_size: int, g: int, rows_per_program: int) -> "KernelFields":
        work = [(i, row) for i, s in enumerate(seqs) for row in range(0, s.query_len, rows_per_program // g)]
        masks = [_new_token_mask(s) for s in seqs]  # [Q, Q] bool each, None when causal
        starts = accumulate((0 if m is None else m.numel() for m in masks), initial=0)
        offsets = [-1 if m is None else start for m, start in zip(masks, starts)]
        num_blocks = max((-(-s.seq_len // block_size) for s in seqs), default=0)
        tables = torch.zeros(len(seqs), num_blocks, dtype=torch.int32)
        for i, s in enumerate(seqs):
            nb = -(-s.seq_len // block_size)
            tables[i, :nb] = torch.tensor(s.block_table[:nb], dtype=torch.int32)
        flat_masks = [m.flatten() for m in masks if m is not None] or [torch.zeros(1, dtype=torch.bool)]
        per_seq = torch.tensor([[s.query_start for s in seqs], [s.query_len for s in seqs],
                                [s.seq_len for s in seqs], offsets], dtype=torch.int32).view(4, len(seqs))
        work_ints = torch.tensor([[i for i, _ in work], [row for _, row in work]], dtype=torch.int32)
        return cls(per_seq, work_ints.view(2, len(work)), tables, torch.cat(flat_masks).to(torch.int8))


def _rows_per_program(max_query_len: int, g: int) -> int:
    """G * query rows, a power of two: 16 (tl.dot's least M) up to 64, or G's own if larger."""
    def pow2(n: int) -> int:
        return 1 << (n - 1).bit_length()

    return max(16, min(64, pow2(g * max_query_len)), pow2(g))


def _new_token_mask(s: SeqAttentionInput) -> torch.Tensor | None:
    """The mask's columns over the new tokens, [Q, Q] bool; None when causal. The kernel
    masks new tokens only: mask columns over cached keys must all be True."""
    if s.mask is None:
        return None
    q, m = s.mask.shape
    assert q == s.query_len and s.query_len <= m <= s.seq_len, (s.mask.shape, s.query_len, s.seq_len)
    assert bool(s.mask[:, :m - q].all()), "a new token must see the whole cached context"
    return s.mask[:, m - q:]


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot of every new token
    groups: list[AttentionGroup]  # for the reference backend; empty when built for a kernel
    num_tokens: int
    kernel: KernelMetadata | None = None  # for a fused kernel (build(..., for_kernel=True))

    @classmethod
    def build(cls, seqs: list[SeqAttentionInput], slot_mapping: torch.Tensor, block_size: int,
              num_queries_per_kv: int, device: torch.device, for_kernel: bool = False,
              window: int | None = None) -> "AttentionMetadata":
        """window: the model's sliding window, for the reference backend's masks (a kernel
        backend applies it itself: TritonAttentionBackend(window=))."""
        num_tokens = sum(s.query_len for s in seqs)
        if for_kernel:
            return cls(slot_mapping, [], num_tokens, KernelMetadata.build(seqs, block_size, num_queries_per_kv, device))
        short = [s for s in seqs if s.query_len <= MAX_BATCHED_QUERY_LEN]
        groups = [_build_group(g, block_size, num_queries_per_kv, device, window)
                  for g in ([short] if short else []) + [[s] for s in seqs if s.query_len > MAX_BATCHED_QUERY_LEN]]
        return cls(slot_mapping, groups, num_tokens)


def _window_mask(s: SeqAttentionInput, key_len: int, window: int) -> torch.Tensor:
    """[Q, L] bool: the keys a sliding window leaves to each new token of s, whose position
    is its key index when causal and, under a tree mask, the first masked key's index plus
    the number of its masked keys (its ancestors) minus one. A query at position p sees keys
    at positions p - window + 1 .. p; keys inside the mask's region (a tree's own nodes, within
    a few positions of the query) are left to the mask."""
    masked = 0 if s.mask is None else s.mask.shape[1]
    first_masked = s.seq_len - masked
    if s.mask is None:
        positions = torch.arange(s.seq_len - s.query_len, s.seq_len)  # [Q]
    else:
        positions = first_masked + s.mask.sum(1) - 1  # [Q]
    keys = torch.arange(key_len)[None, :]  # [1, L]
    return (keys > positions[:, None] - window) | (keys >= first_masked)


def _build_group(seqs: list[SeqAttentionInput], block_size: int, g: int, device,
                 window: int | None = None) -> AttentionGroup:
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
        else:  # the keys before the mask's last M are seen by every new token
            q, m = s.mask.shape
            assert q == s.query_len and s.query_len <= m <= s.seq_len, (s.mask.shape, s.query_len, s.seq_len)
            mask[i, :q, :s.seq_len - m] = True
            mask[i, :q, s.seq_len - m:s.seq_len] = s.mask
        if window is not None and s.seq_len > window:
            mask[i, :s.query_len] &= _window_mask(s, key_len, window)
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
    needs_kernel_metadata = False  # AttentionMetadata.build(..., for_kernel=...)

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
