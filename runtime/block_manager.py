"""Paged KV cache bookkeeping: fixed-size blocks, a free list, per-sequence block tables.

Blocks are reference counted so that later prefix sharing (several sequences reading one
block) needs no new mechanism: a block returns to the free list when its last reader lets
go. The manager only does arithmetic on block ids; the tensors live in target_gpu.kv_cache.
"""
from __future__ import annotations

from collections import deque

from runtime.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` still needs to hold its computed tokens plus `num_new_tokens`."""
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_missing_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def may_append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq's block table so the next `num_new_tokens` tokens have slots."""
        missing = self.num_missing_blocks(seq, num_new_tokens)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {missing}, {self.num_free_blocks} free")
        for _ in range(missing):
            block_id = self.free_block_ids.popleft()
            assert self.ref_counts[block_id] == 0
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Drop seq's hold on all its blocks."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table.clear()

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the blocks needed for the first `num_tokens` tokens (rollback)."""
        keep = self.num_blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def _release(self, block_id: int) -> None:
        assert self.ref_counts[block_id] > 0, f"block {block_id} freed twice"
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_block_ids.append(block_id)

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat cache slot of token `position` of `seq`."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
