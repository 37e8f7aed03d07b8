"""BlockManager: paged KV block bookkeeping, checked against a plain model of the pool."""
from __future__ import annotations

import random

import pytest

from runtime.block_manager import BlockManager
from runtime.sampling_params import SamplingParams
from runtime.sequence import Sequence


def make_seq(num_tokens: int, name: str = "s") -> Sequence:
    return Sequence(name, list(range(num_tokens)), SamplingParams())


def grow(bm: BlockManager, seq: Sequence, n: int) -> None:
    """What the engine does for a step of n tokens: allocate, then count them computed."""
    bm.may_append(seq, n)
    seq.num_computed_tokens += n


def share(bm: BlockManager, src: Sequence, dst: Sequence) -> None:
    """A second reader of src's blocks (how prefix sharing will use the ref counts)."""
    for block_id in src.block_table:
        bm.ref_counts[block_id] += 1
        dst.block_table.append(block_id)
    dst.num_computed_tokens = src.num_computed_tokens


def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_allocate_and_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(10)
    assert bm.num_missing_blocks(seq, 10) == 3
    assert bm.can_allocate(seq, 10)
    grow(bm, seq, 10)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 5 and bm.num_used_blocks == 3
    assert all(bm.ref_counts[b] == 1 for b in seq.block_table)
    # two more tokens fit in the third block; a third needs a fourth block
    assert bm.num_missing_blocks(seq, 2) == 0
    assert bm.num_missing_blocks(seq, 3) == 1
    grow(bm, seq, 2)
    assert len(seq.block_table) == 3
    grow(bm, seq, 1)
    assert len(seq.block_table) == 4
    table = list(seq.block_table)
    bm.free(seq)
    assert seq.block_table == []
    assert bm.num_free_blocks == 8
    assert all(bm.ref_counts[b] == 0 for b in table)


def test_slots_follow_the_block_table():
    bm = BlockManager(num_blocks=8, block_size=4)
    other, seq = make_seq(5), make_seq(9)
    grow(bm, other, 5)  # so seq's blocks are not 0, 1, 2
    grow(bm, seq, 9)
    slots = [bm.slot(seq, p) for p in range(9)]
    assert slots == [seq.block_table[p // 4] * 4 + p % 4 for p in range(9)]
    assert len(set(slots)) == 9
    assert not set(slots) & {bm.slot(other, p) for p in range(5)}


def test_out_of_blocks_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = make_seq(20)
    assert not bm.can_allocate(seq, 13)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.may_append(seq, 13)
    assert seq.block_table == [] and bm.num_free_blocks == 3
    assert bm.can_allocate(seq, 12)


def test_truncate_releases_trailing_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(14)
    grow(bm, seq, 14)
    head = seq.block_table[:2]
    bm.truncate(seq, 5)  # tokens 0..4 need 2 blocks
    assert seq.block_table == head
    assert bm.num_free_blocks == 6
    bm.truncate(seq, 8)  # already short enough
    assert seq.block_table == head
    bm.truncate(seq, 0)
    assert seq.block_table == [] and bm.num_free_blocks == 8


def test_shared_blocks_return_when_the_last_reader_lets_go():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = make_seq(8, "a"), make_seq(8, "b")
    grow(bm, a, 8)
    share(bm, a, b)
    assert all(bm.ref_counts[x] == 2 for x in a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 2  # b still reads both blocks
    bm.truncate(b, 4)
    assert bm.num_free_blocks == 3
    bm.free(b)
    assert bm.num_free_blocks == 4 and bm.ref_counts == [0] * 4


def test_double_free_asserts():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(6)
    grow(bm, seq, 6)
    table = list(seq.block_table)
    bm.free(seq)
    seq.block_table = table  # a stale table: freeing it again is a bug the manager must catch
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(seq)


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_keep_the_pool_consistent(seed):
    """Random allocate / append / truncate / free / share on many sequences, checked after
    every operation against a plain model: ref count of a block == number of tables that
    hold it, free blocks are exactly those with count 0, and every table covers its tokens."""
    rng = random.Random(seed)
    num_blocks, block_size = rng.choice([(16, 1), (32, 4), (64, 16), (7, 3)])
    bm = BlockManager(num_blocks, block_size)
    allow_sharing = seed % 2 == 0  # odd seeds: every block in at most one table
    live: list[Sequence] = []
    for step in range(2000):
        op = rng.random()
        if op < 0.45 or not live:  # append tokens to a new or live sequence
            seq = rng.choice(live) if live and rng.random() < 0.7 else make_seq(0, f"s{step}")
            n = rng.randint(1, 3 * block_size)
            fits = bm.can_allocate(seq, n)
            assert fits == (-(-(seq.num_computed_tokens + n) // block_size) - len(seq.block_table)
                            <= bm.num_free_blocks)
            if fits:
                grow(bm, seq, n)
                if seq not in live:
                    live.append(seq)
            else:
                free_before = bm.num_free_blocks
                with pytest.raises(RuntimeError):
                    bm.may_append(seq, n)
                assert bm.num_free_blocks == free_before
        elif op < 0.65:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
            assert seq.block_table == []
        elif op < 0.85 or not allow_sharing:
            seq = rng.choice(live)
            keep = rng.randint(0, seq.num_computed_tokens)
            bm.truncate(seq, keep)
            seq.num_computed_tokens = keep
        else:
            src = rng.choice(live)
            dst = make_seq(0, f"shared{step}")
            share(bm, src, dst)
            live.append(dst)
        check_pool(bm, live)
    for seq in live:
        bm.free(seq)
    assert bm.num_free_blocks == num_blocks and not any(bm.ref_counts)


def check_pool(bm: BlockManager, live: list[Sequence]) -> None:
    holders: dict[int, int] = {}
    for seq in live:
        assert len(seq.block_table) == -(-seq.num_computed_tokens // bm.block_size)
        assert len(set(seq.block_table)) == len(seq.block_table)
        for b in seq.block_table:
            holders[b] = holders.get(b, 0) + 1
    assert list(bm.ref_counts) == [holders.get(b, 0) for b in range(bm.num_blocks)]
    free = list(bm.free_block_ids)
    assert len(free) == len(set(free)), "a block is on the free list twice"
    assert set(free) == {b for b in range(bm.num_blocks) if b not in holders}
    assert bm.num_free_blocks + len(holders) == bm.num_blocks
    if all(count == 1 for count in holders.values()):  # no sharing: no block in two tables
        assert bm.num_free_blocks + sum(len(s.block_table) for s in live) == bm.num_blocks


def test_blocks_behind_a_sliding_window_are_given_back_and_stay_cached():
    """Window 8, blocks of 4: a query at position p sees keys p-7..p, so once 30 tokens are
    committed (later queries at 30 on) positions 0..22 are behind every later query: blocks
    0-4 go back, block 5 (20..23) stays for key 23. The null block stands in their place,
    free() skips it, and the blocks given back stay cached for the next request."""
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True, sliding_window=8)
    seq = make_seq(31)
    grow(bm, seq, 30)
    bm.commit(seq)
    assert seq.block_table[:5] == [bm.null_block] * 5 and bm.null_block == 16
    assert bm.null_block not in seq.block_table[5:] and bm.num_used_blocks == 3
    grow(bm, seq, 1)  # position 30 committed: later queries see 24 on, block 5 goes too
    bm.commit(seq)
    assert seq.block_table[5] == bm.null_block and seq.num_freed_blocks == 6 and bm.num_used_blocks == 2
    bm.free(seq)
    assert bm.num_free_blocks == 16 and not seq.block_table and seq.num_freed_blocks == 0
    again = make_seq(31, "again")
    assert bm.claim_cached_prefix(again) == 28  # every full block of the prompt but the last token's


def test_without_a_window_commit_only_caches():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    seq = make_seq(31)
    grow(bm, seq, 30)
    bm.commit(seq)
    assert bm.null_block not in seq.block_table and bm.num_used_blocks == 8 and bm.num_cached_blocks == 7
