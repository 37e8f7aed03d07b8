"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, per-sequence block
tables, and automatic prefix caching. The manager only does arithmetic on block ids; the
tensors live in target_gpu.kv_cache. Without prefix caching a sequence is anything with a
`block_table` and `num_computed_tokens` (the draft worker and the EAGLE head keep their own
caches that way); with it, a runtime.sequence.Sequence.

Prefix caching (`enable_prefix_caching=True`; the engine's default). A block that holds
`block_size` committed tokens of a sequence is named by a hash chained over the previous
block's hash and its own token ids, so a hash names the whole prefix up to the block's
end. Only committed tokens are hashed: draft nodes live past `num_computed_tokens` and
never enter the cache. A sequence joining the batch takes the longest run of its leading
full blocks that the cache holds (the hash and the token ids must both match), except its
last token, whose logits it needs; it then computes only the rest. Only full blocks are
shared, and a sequence writes only at positions past its committed tokens, so no sequence
ever writes into a block another can read.

A block whose last holder lets go keeps its contents and hash: it waits among the
evictable blocks, still a cache hit, until the allocator needs it. Allocation takes
blocks that hold nothing first, then evicts the least recently freed cached block.

Sliding windows (`sliding_window`: Mistral, Qwen2). Once a sequence's committed tokens
move on, a block wholly before the window of every query it will still run is given back
(`commit`), as any released block (a cached one stays a cache hit), and its entry in the
block table becomes the null block: the id past the managed ones, which the KV cache holds
as its scratch block (target_gpu.kv_cache). Attention masks every key there by the window,
so nothing there is attended to; tables keep their length, so positions still index them.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from runtime.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 sliding_window: int | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.null_block = num_blocks  # stands for blocks given back outside the window
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))  # free and holding nothing worth keeping
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free, still cached; least recently freed first
        self.cached: dict[bytes, int] = {}  # prefix hash -> the block holding that prefix's last block_size tokens
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: empty ones and evictable cached ones."""
        return len(self.free_block_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose contents are a cached prefix (in use or evictable)."""
        return len(self.cached)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` still needs to hold its computed tokens plus `num_new_tokens`."""
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_missing_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def fitting(self, demands: list[tuple[Sequence, int]]) -> list[bool]:
        """Which (seq, new tokens) demands the free blocks cover when allocated together, taken
        in order (each may fit alone while two cannot share the last free block)."""
        free, fits = self.num_free_blocks, []
        for seq, num_new_tokens in demands:
            need = self.num_missing_blocks(seq, num_new_tokens)
            fits.append(need <= free)
            if need <= free:
                free -= need
        return fits

    def may_append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq's block table so the next `num_new_tokens` tokens have slots."""
        missing = self.num_missing_blocks(seq, num_new_tokens)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {missing}, {self.num_free_blocks} free")
        for _ in range(missing):
            block_id = self._take_free_block()
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Drop seq's hold on all its blocks; its full committed blocks stay cached. The
        tail goes first, so that it is evicted before the head, which more requests share."""
        if self.enable_prefix_caching:
            self.cache_committed_blocks(seq)
            seq.num_cached_blocks = 0
        for block_id in reversed(seq.block_table[seq.num_freed_blocks:]):
            self._release(block_id)
        seq.block_table.clear()
        seq.num_freed_blocks = 0

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the blocks needed for the first `num_tokens` tokens (rollback)."""
        keep = self.num_blocks_for(num_tokens)
        assert not self.enable_prefix_caching or keep >= seq.num_cached_blocks, "rollback into committed blocks"
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def commit(self, seq: Sequence) -> None:
        """After seq's committed tokens grew: name its new full blocks in the prefix cache,
        and give back the blocks the window has left behind (the module docstring)."""
        self.cache_committed_blocks(seq)
        if self.sliding_window is None:
            return
        # later queries sit at num_computed_tokens on and see keys after position - window
        first_key = seq.num_computed_tokens - self.sliding_window + 1
        num_behind = min(max(0, first_key) // self.block_size, len(seq.block_table))
        for i in range(seq.num_freed_blocks, num_behind):
            self._release(seq.block_table[i])
            seq.block_table[i] = self.null_block
        seq.num_freed_blocks = max(seq.num_freed_blocks, num_behind)

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat cache slot of token `position` of `seq`."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    # ---- prefix caching -------------------------------------------------------------------
    def claim_cached_prefix(self, seq: Sequence) -> int:
        """For a sequence that holds no blocks: take the cached blocks of its longest cached
        prefix of full blocks (never its last token) and count them as computed. Returns the
        tokens served from the cache."""
        if not self.enable_prefix_caching or not seq.reads_prefix_cache or seq.block_table:
            return 0
        assert seq.num_computed_tokens == 0
        num_full = (seq.num_tokens - 1) // self.block_size
        for i in range(num_full):
            block_id = self.cached.get(self._prefix_hash(seq, i))
            if block_id is None or self.block_tokens[block_id] != self._block_token_ids(seq, i):
                break
            if self.ref_counts[block_id] == 0:
                del self.evictable[block_id]
            self.ref_counts[block_id] += 1
            seq.block_table.append(block_id)
        seq.num_cached_blocks = len(seq.block_table)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        return seq.num_computed_tokens

    def cache_committed_blocks(self, seq: Sequence) -> None:
        """Name every full block of seq's committed tokens by its prefix hash, so later
        sequences can take it. A prefix cached already in another block stays there."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_tokens, len(seq.block_table) * self.block_size) \
            // self.block_size
        for i in range(seq.num_cached_blocks, num_full):
            prefix_hash = self._prefix_hash(seq, i)
            block_id = seq.block_table[i]
            if prefix_hash not in self.cached and self.block_hashes[block_id] is None:
                self.cached[prefix_hash] = block_id
                self.block_hashes[block_id] = prefix_hash
                self.block_tokens[block_id] = self._block_token_ids(seq, i)
        seq.num_cached_blocks = max(seq.num_cached_blocks, num_full)

    def _block_token_ids(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _prefix_hash(self, seq: Sequence, i: int) -> bytes:
        """Hash of seq's first (i + 1) full blocks, chained block by block (memoized on seq:
        its tokens only ever grow). SHA-256, so that a request cannot craft a collision with
        another's prefix."""
        hashes = seq.block_hashes
        while len(hashes) <= i:
            parent = hashes[-1] if hashes else b""
            tokens = array("q", self._block_token_ids(seq, len(hashes)))
            hashes.append(hashlib.sha256(parent + tokens.tobytes()).digest())
        return hashes[i]

    def _take_free_block(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        else:
            block_id, _ = self.evictable.popitem(last=False)
            del self.cached[self.block_hashes[block_id]]
            self.block_hashes[block_id] = self.block_tokens[block_id] = None
        assert self.ref_counts[block_id] == 0
        return block_id

    def _release(self, block_id: int) -> None:
        assert self.ref_counts[block_id] > 0, f"block {block_id} freed twice"
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            if self.block_hashes[block_id] is None:
                self.free_block_ids.append(block_id)
            else:
                self.evictable[block_id] = None
