"""Triton attention over the paged KV cache: one launch for the whole ragged step
(prefill chunks, decodes and tree verification alike), the fast path on CUDA.

Layout. The grid is (W, Hkv): program (w, h) takes query rows work_row[w] ..
work_row[w] + R - 1 of sequence work_seq[w] (KernelMetadata's work list, R =
rows_per_program // G) for KV head h and the G query heads that share it. Those G heads
are folded into the M dimension of the tile, row r = (query row r // G, head h*G + r % G),
so each K/V tile is loaded once for the whole group (grouped-query attention, Ainslie et
al. 2023). The program walks the sequence's keys BLOCK_N positions at a time, finding
each position's slot through the block table (block_tables[b, pos // block_size] *
block_size + pos % block_size, so any block size works), and keeps a running max and
sum (online softmax, FlashAttention: Dao et al. 2022) with fp32 accumulation; the
output is written in q's dtype.

Masking. A new token j of a sequence with context_len = seq_len - query_len sees every
key < context_len, plus the new tokens its mask row allows: i <= j when causal (the
sequence brings no mask, mask_offset -1), else masks[mask_offset + j * query_len + i],
the sequence's [query_len, query_len] tree mask over its new tokens stored flat (int8).
Causal rows stop at their own position; tree rows walk the whole sequence. With a sliding
window W (Mistral, Qwen2), a row at position p sees keys after p - W only (a tree node's
position: context_len + its depth, counted from its mask row; the tree's own nodes are left
to the mask, as in the reference), and programs start at their first row's window, so the
blocks behind it, given back to the pool (runtime.block_manager), are never loaded.

Key splits ("flash decoding", Dao et al. 2023). A decode at batch 1 has only Hkv
programs, too few for a GPU of 132 SMs, each walking the whole context. When a step has
fewer than TARGET_PROGRAMS programs and long sequences (num_key_splits), a third grid
axis cuts every program's key range into NUM_SPLITS parts of equal length (multiples of
BLOCK_N, computed in the kernel from the sequence's length, so a CUDA graph captured with
one split count serves any length). Each part writes its normalized partial output and
its log-sum-exp (fp32, [S, T, Hq]); a merge kernel weighs the parts by exp2(lse - max).

Before attending, a second small kernel writes the step's k/v into their slots
(slot_mapping), one program per token and every KV head in it.

Triton is imported when present; the kernels are compiled on first use, so
TRITON_INTERPRET=1 (Triton's CPU interpreter, which the tests use) is read then rather
than when this module is imported. The reference (target_gpu.attention) is the oracle.
"""
from __future__ import annotations

import functools
import math

import torch

from target_gpu.attention import AttentionMetadata
from target_gpu.kv_cache import KVCache

try:
    import triton
    import triton.language as tl
except ImportError:  # the module still imports; the backend says why it cannot run
    triton = tl = None

BLOCK_N = 32  # keys per step of the loop
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
TARGET_PROGRAMS = 512  # key splits are added until a step has about this many programs (~4 per SM)
MIN_KEYS_PER_SPLIT = 256  # ... but no part walks fewer keys than this
MAX_SPLITS = 32


def num_key_splits(num_programs: int, max_seq_len: int) -> int:
    """Parts each program's key range is cut into: 1 when the step already has
    TARGET_PROGRAMS programs or its sequences are short; else enough to reach about
    TARGET_PROGRAMS, at most MAX_SPLITS, none of fewer than MIN_KEYS_PER_SPLIT keys."""
    if num_programs >= TARGET_PROGRAMS:
        return 1
    return max(1, min(MAX_SPLITS, -(-TARGET_PROGRAMS // num_programs), max_seq_len // MIN_KEYS_PER_SPLIT))


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return bool(triton is not None and triton.knobs.runtime.interpret)


def unsupported_reason(kv_cache: KVCache) -> str | None:
    """Why the Triton backend cannot run over this cache here; None when it can."""
    cache = kv_cache.k[0]  # [num_blocks, block_size, Hkv, D]
    if triton is None:
        return "it needs the triton package, which does not import here"
    if cache.device.type != "cuda" and not interpreting():
        return (f"it runs on CUDA and the KV cache is on {cache.device} (TRITON_INTERPRET=1 interprets it on the "
                "CPU, slowly: for tests)")
    if cache.shape[3] not in SUPPORTED_HEAD_DIMS:
        return f"it supports head_dim {SUPPORTED_HEAD_DIMS}, not {cache.shape[3]}"
    return None


def _paged_attention(out_ptr, part_ptr, lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                     query_start_ptr, query_len_ptr, seq_len_ptr, block_tables_ptr, mask_offset_ptr, masks_ptr,
                     work_seq_ptr, work_row_ptr,
                     scale_log2, num_tokens, stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
                     NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
                     NUM_SPLITS: tl.constexpr, WINDOW: tl.constexpr):
    work = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(work_seq_ptr + work)
    first_row = tl.load(work_row_ptr + work)
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_len_ptr + seq)
    seq_len = tl.load(seq_len_ptr + seq)
    mask_offset = tl.load(mask_offset_ptr + seq)
    context_len = seq_len - query_len
    is_tree = mask_offset >= 0

    # tile row r: query row j of head kv_head * G + r % G
    r = tl.arange(0, BLOCK_M)
    j = first_row + r // G  # [M]
    row_ok = (r < (BLOCK_M // G) * G) & (j < query_len)  # [M]
    # compared per row, not as the scalar is_tree: Triton 3.9's interpreter gives a scalar
    # bool & a tensor int32 data, which tl.load refuses as a mask
    tree_row = row_ok & (mask_offset + 0 * j >= 0)  # [M]
    d = tl.arange(0, HEAD_DIM)
    q_rows = (query_start + j) * stride_qt + (kv_head * G + r % G) * stride_qh  # [M]
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)  # [M, D]

    # masked scores are -1e30, not -inf: a row that has seen nothing yet stays free of NaN
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # running max of the scores (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    last_row = tl.minimum(first_row + BLOCK_M // G, query_len)  # exclusive
    kv_end = context_len + last_row  # causal rows stop at their own position
    if is_tree:
        kv_end = seq_len
    kv_start = 0
    q_pos = context_len + j  # [M] each row's position (a causal row's)
    if WINDOW > 0:  # a row at position p sees keys after p - WINDOW; a tree node sits at its depth
        first_pos = context_len + first_row
        if is_tree:
            first_pos = context_len
            ancestors = tl.zeros([BLOCK_M], tl.int32)  # the node and its ancestors: its mask row's count
            for c0 in range(0, query_len, BLOCK_N):
                c = c0 + tl.arange(0, BLOCK_N)
                row_mask = tl.load(masks_ptr + mask_offset + j[:, None] * query_len + c[None, :],
                                   mask=tree_row[:, None] & (c < query_len)[None, :], other=0)
                ancestors += tl.sum((row_mask != 0).to(tl.int32), 1)
            q_pos = context_len + ancestors - 1
        kv_start = tl.maximum(first_pos - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    part_len = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), BLOCK_N) * BLOCK_N  # this split's keys: [lo, hi)
    lo = kv_start + split * part_len
    hi = tl.minimum(lo + part_len, kv_end)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # [N] key positions
        n_ok = n < hi
        block = tl.load(block_tables_ptr + seq * stride_table + n // BLOCK_SIZE, mask=n_ok, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE  # [N]
        kv_offs = (slot * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + d[None, :]  # [N, D] in a contiguous pool
        k = tl.load(k_cache_ptr + kv_offs, mask=n_ok[:, None], other=0.0)  # [N, D]
        v = tl.load(v_cache_ptr + kv_offs, mask=n_ok[:, None], other=0.0)  # [N, D]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [M, N]

        i = n - context_len  # [N] index among the new tokens; < 0 in the context
        new = (i >= 0)[None, :]
        tree_ok = tl.load(masks_ptr + mask_offset + j[:, None] * query_len + i[None, :],
                          mask=tree_row[:, None] & new & n_ok[None, :], other=0) != 0
        sees_new = tl.where(is_tree, tree_ok, i[None, :] <= j[:, None])
        visible = n_ok[None, :] & (~new | sees_new)
        if WINDOW > 0:  # a tree's own nodes are left to its mask
            visible &= (n[None, :] > q_pos[:, None] - WINDOW) | (new & tree_row[:, None])
        s = tl.where(visible, s, -1.0e30)

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)  # [M]
        p = tl.exp2(s - m_new[:, None])  # [M, N]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    head = kv_head * G + r % G  # [M]
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        o_rows = (query_start + j) * stride_ot + head * stride_oh  # [M]
        tl.store(out_ptr + o_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:  # this part's normalized output and log2-sum-exp2; an empty part weighs nothing
        seen = l_i > 0
        l_safe = tl.where(seen, l_i, 1.0)
        part_rows = (split * num_tokens + query_start + j) * (NUM_KV_HEADS * G) + head  # [M] in [S, T, Hq]
        tl.store(part_ptr + part_rows[:, None] * HEAD_DIM + d[None, :], acc / l_safe[:, None], mask=row_ok[:, None])
        tl.store(lse_ptr + part_rows, tl.where(seen, m_i + tl.log2(l_safe), -1.0e30), mask=row_ok)


def _merge_splits(out_ptr, part_ptr, lse_ptr, num_tokens, stride_ot, stride_oh,
                  NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
                  HEAD_DIM: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_P2)
    ok = s < NUM_SPLITS
    rows = (s * num_tokens + t) * NUM_HEADS + h  # [S] in [S, T, Hq]
    lse = tl.load(lse_ptr + rows, mask=ok, other=-1.0e30)  # [S]
    weight = tl.where(ok, tl.exp2(lse - tl.max(lse, 0)), 0.0)  # [S]
    d = tl.arange(0, HEAD_DIM)
    parts = tl.load(part_ptr + rows[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0)  # [S, D]
    out = tl.sum(weight[:, None] * parts, 0) / tl.sum(weight, 0)  # [D]
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def _write_kv(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
              NUM_KV_HEADS: tl.constexpr, HEADS_P2: tl.constexpr, HEAD_DIM: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, HEADS_P2)[:, None]  # [Hp2, 1]
    d = tl.arange(0, HEAD_DIM)[None, :]  # [1, D]
    ok = h < NUM_KV_HEADS
    dst = (slot * NUM_KV_HEADS + h) * HEAD_DIM + d  # [Hp2, D]
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=ok), mask=ok)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=ok), mask=ok)


@functools.cache
def _kernels(interpret: bool):
    """(attention, merge_splits, write_kv), jitted now (TRITON_INTERPRET is read here); one set per mode."""
    del interpret  # the cache key only
    return triton.jit(_paged_attention), triton.jit(_merge_splits), triton.jit(_write_kv)


class TritonAttentionBackend:
    """Paged attention in Triton (CUDA, or CPU under TRITON_INTERPRET=1); the interface of
    TorchAttentionBackend, with AttentionMetadata built for_kernel."""

    name = "triton"
    needs_kernel_metadata = True

    def __init__(self, kv_cache: KVCache, window: int | None = None):
        """window: the model's sliding window (None: none)."""
        reason = unsupported_reason(kv_cache)
        if reason:
            raise ValueError(f"attention backend 'triton' cannot run: {reason} (use --attention-backend torch)")
        self.kv_cache, self.window = kv_cache, window

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # q [T, Hq, D]; k, v [T, Hkv, D] -> out [T, Hq, D]
        k_cache, v_cache = self.kv_cache.k[layer_idx], self.kv_cache.v[layer_idx]
        num_tokens, num_kv_heads, head_dim = k.shape
        attention_kernel, merge_kernel, write_kv_kernel = _kernels(interpreting())
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if num_tokens == 0:
            return out
        assert q.stride(2) == k.stride(2) == v.stride(2) == 1, "head_dim must be contiguous"
        write_kv_kernel[(num_tokens,)](
            k, v, k_cache, v_cache, meta.slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            NUM_KV_HEADS=num_kv_heads, HEADS_P2=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim)
        km = meta.kernel
        num_programs = km.work_seq.shape[0]
        splits = km.num_splits or num_key_splits(num_programs * num_kv_heads, km.max_seq_len)
        part = lse = out  # unread when there is one split
        if splits > 1:
            part = torch.empty(splits, num_tokens, q.shape[1], head_dim, dtype=torch.float32, device=q.device)
            lse = torch.empty(splits, num_tokens, q.shape[1], dtype=torch.float32, device=q.device)
        attention_kernel[(num_programs, num_kv_heads, splits)](
            out, part, lse, q, k_cache, v_cache, km.query_start, km.query_len, km.seq_len, km.block_tables,
            km.mask_offset, km.masks, km.work_seq, km.work_row, math.log2(math.e) / math.sqrt(head_dim), num_tokens,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), km.block_tables.stride(0),
            NUM_KV_HEADS=num_kv_heads, G=q.shape[1] // num_kv_heads, BLOCK_M=km.rows_per_program, BLOCK_N=BLOCK_N,
            HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", NUM_SPLITS=splits, WINDOW=self.window or 0)
        if splits > 1:
            merge_kernel[(num_tokens, q.shape[1])](
                out, part, lse, num_tokens, out.stride(0), out.stride(1), NUM_HEADS=q.shape[1], NUM_SPLITS=splits,
                SPLITS_P2=triton.next_power_of_2(splits), HEAD_DIM=head_dim)
        return out
