"""Automatic prefix caching: the block manager against a plain model of what each block
holds, and the engine (default model, float32) against itself with caching off."""
from __future__ import annotations

import random

import pytest

from runtime.block_manager import BlockManager
from runtime.sampling_params import SamplingParams
from runtime.sequence import Sequence


class PoolModel:
    """What a test can know without the manager's hashes: the token each KV slot was last
    written with, and which whole prefix each block was registered for (cleared when the
    block is handed out again)."""

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.contents: dict[int, list] = {b: [None] * bm.block_size for b in range(bm.num_blocks)}
        self.prefix_of: dict[int, tuple] = {}  # block -> the tokens from position 0 to its end
        self.release_time: dict[int, int] = {}  # block -> when its count last fell to 0
        self.clock = 0

    def allocate(self, seq: Sequence, num_new: int) -> None:
        """may_append, checked: a block holding a prefix is only taken when no empty block is
        left, and then the least recently released one."""
        before = len(seq.block_table)
        plain_free = [b for b in range(self.bm.num_blocks) if self.bm.ref_counts[b] == 0 and b not in self.prefix_of]
        cached_free = sorted((self.release_time[b], b) for b in range(self.bm.num_blocks)
                             if self.bm.ref_counts[b] == 0 and b in self.prefix_of)
        self.bm.may_append(seq, num_new)
        for block_id in seq.block_table[before:]:
            if block_id in self.prefix_of:
                assert not plain_free, "evicted a cached block while empty ones were free"
                assert block_id == cached_free.pop(0)[1], "evicted a cached block that was not the least recent"
                del self.prefix_of[block_id]
            else:
                plain_free.remove(block_id)

    def write(self, seq: Sequence, first: int, tokens: list[int]) -> None:
        """The target writes KV for tokens at positions first.. of seq: never into a block
        that another sequence holds or that the cache names."""
        for offset, token in enumerate(tokens):
            position = first + offset
            block_id = seq.block_table[position // self.bm.block_size]
            assert self.bm.ref_counts[block_id] == 1, f"write into block {block_id} held by others"
            assert block_id not in self.prefix_of, f"write into cached block {block_id}"
            self.contents[block_id][position % self.bm.block_size] = token

    def note_registered(self, seq: Sequence, blocks: list[int]) -> None:
        """After the manager named blocks (seq's table, in order): each holds seq's prefix
        up to its end (check() then compares that with what was written)."""
        for i, block_id in enumerate(blocks):
            if self.bm.block_hashes[block_id] is not None and block_id not in self.prefix_of:
                self.prefix_of[block_id] = tuple(seq.token_ids[:(i + 1) * self.bm.block_size])

    def commit(self, seq: Sequence) -> None:
        self.bm.cache_committed_blocks(seq)
        self.note_registered(seq, seq.block_table)

    def free(self, seq: Sequence) -> None:
        held = list(seq.block_table)
        self.bm.free(seq)
        self.note_registered(seq, held)
        for block_id in reversed(held):
            if self.bm.ref_counts[block_id] == 0:
                self.clock += 1
                self.release_time[block_id] = self.clock

    def expected_hit_blocks(self, seq: Sequence) -> int:
        """Longest run of leading full blocks (never the last token) some block holds."""
        holders = set(self.prefix_of.values())
        n = 0
        while (n + 1) * self.bm.block_size <= seq.num_tokens - 1 and \
                tuple(seq.token_ids[:(n + 1) * self.bm.block_size]) in holders:
            n += 1
        return n

    def check(self, live: list[Sequence]) -> None:
        bm = self.bm
        holders: dict[int, int] = {}
        for seq in live:
            for b in seq.block_table:
                holders[b] = holders.get(b, 0) + 1
            for position in range(seq.num_computed_tokens):  # every computed token's KV is its own
                block_id = seq.block_table[position // bm.block_size]
                assert self.contents[block_id][position % bm.block_size] == seq.token_ids[position]
        assert list(bm.ref_counts) == [holders.get(b, 0) for b in range(bm.num_blocks)]
        empty, evictable = list(bm.free_block_ids), list(bm.evictable)
        assert len(set(empty)) == len(empty) and not set(empty) & set(evictable)
        assert set(empty) | set(evictable) == {b for b in range(bm.num_blocks) if b not in holders}
        assert {b for b, h in enumerate(bm.block_hashes) if h is not None} == set(self.prefix_of)
        assert sorted(bm.cached.values()) == sorted(self.prefix_of)
        assert not set(empty) & set(self.prefix_of), "an empty free block still named in the cache"
        for block_id, prefix in self.prefix_of.items():  # a cached block holds what its prefix says
            assert tuple(self.contents[block_id]) == prefix[-bm.block_size:]
            assert bm.block_tokens[block_id] == prefix[-bm.block_size:]


@pytest.mark.parametrize("seed", range(6))
def test_random_prefix_caching_against_a_model(seed):
    """Random sequences sharing prefixes join (taking cached blocks), prefill in chunks,
    decode with drafts that are partly rejected, finish, and are preempted, in a small pool
    that forces evictions. After every operation: reference counts equal the tables that
    hold each block, the free lists are exactly the unheld blocks, a hit is the longest
    cached run of full blocks and its KV is the sequence's own tokens, cached blocks hold
    their prefix, no write lands in a shared or cached block, and evictions go least
    recently released first."""
    rng = random.Random(seed)
    num_blocks, block_size = rng.choice([(12, 2), (24, 4), (10, 3)])
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    model = PoolModel(bm)
    stems = [[rng.randrange(4) for _ in range(rng.randint(4, 5 * block_size))] for _ in range(3)]
    live: list[Sequence] = []
    waiting: list[Sequence] = []
    hits = 0
    for step in range(1500):
        op = rng.random()
        if op < 0.2 or not (live or waiting):  # a request arrives
            stem = rng.choice(stems)
            tokens = stem[:rng.randint(1, len(stem))] + [rng.randrange(4) for _ in range(rng.randint(0, 6))]
            waiting.append(Sequence(f"r{step}", tokens, SamplingParams()))
        elif op < 0.35 and waiting:  # the scheduler admits one
            seq = waiting.pop(0)
            expected = model.expected_hit_blocks(seq)
            served = bm.claim_cached_prefix(seq)
            assert served == expected * block_size and len(seq.block_table) == expected
            hits += expected
            if run_step(rng, model, seq):
                live.append(seq)
            else:  # back to the queue; what it took stays cached
                model.free(seq)
                seq.num_computed_tokens = 0
                waiting.insert(0, seq)
        elif op < 0.8 and live:  # a step of a running sequence
            seq = rng.choice(live)
            if not run_step(rng, model, seq):  # preempted: freed, back to the front of the queue
                live.remove(seq)
                model.free(seq)
                seq.num_computed_tokens = 0
                waiting.insert(0, seq)
        elif live:  # a sequence finishes or is aborted
            seq = live.pop(rng.randrange(len(live)))
            model.free(seq)
            assert seq.block_table == []
        model.check(live)
    for seq in live:
        model.free(seq)
    assert bm.num_free_blocks == num_blocks and not any(bm.ref_counts)
    assert hits > 0, "the random run never hit the cache: the test checks nothing"


def run_step(rng: random.Random, model: PoolModel, seq: Sequence) -> bool:
    """One engine step of seq: a prefill chunk, or (once its last token is computed) the
    newest token plus a draft chain of which a random prefix is accepted, then a bonus
    token. False when the pool cannot hold it."""
    num_new = rng.randint(1, seq.num_uncomputed_tokens)
    samples = num_new == seq.num_uncomputed_tokens
    num_draft = rng.randint(0, 3) if samples and num_new == 1 else 0
    if not model.bm.can_allocate(seq, num_new + num_draft):
        return False
    model.allocate(seq, num_new + num_draft)
    accepted = [rng.randrange(4) for _ in range(rng.randint(0, num_draft))]
    draft = accepted + [rng.randrange(4) for _ in range(num_draft - len(accepted))]
    model.write(seq, seq.num_computed_tokens, seq.token_ids[seq.num_computed_tokens:][:num_new] + draft)
    seq.num_computed_tokens += num_new + len(accepted)
    if samples:
        seq.token_ids.extend(accepted + [rng.randrange(4)])
    model.bm.truncate(seq, seq.num_computed_tokens)
    model.commit(seq)
    return True


def test_hit_needs_the_tokens_too():
    """A forged hash entry (a collision) is not served: the block's token ids must match."""
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    first = Sequence("a", [1, 2, 3, 4, 5], SamplingParams())
    bm.may_append(first, 5)
    first.num_computed_tokens = 5
    bm.cache_committed_blocks(first)
    (prefix_hash, block_id), = bm.cached.items()
    bm.block_tokens[block_id] = (9, 9, 9, 9)  # the cache says this hash holds other tokens
    second = Sequence("b", [1, 2, 3, 4, 6], SamplingParams())
    assert bm.claim_cached_prefix(second) == 0
    bm.block_tokens[block_id] = (1, 2, 3, 4)
    assert bm.claim_cached_prefix(second) == 4 and second.block_table == [block_id]


def test_last_token_is_never_served_from_the_cache():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    first = Sequence("a", list(range(9)), SamplingParams())
    bm.may_append(first, 9)
    first.num_computed_tokens = 9
    bm.free(first)
    assert bm.num_cached_blocks == 2
    again = Sequence("b", list(range(8)), SamplingParams())  # 2 full blocks: the second ends on its last token
    assert bm.claim_cached_prefix(again) == 4
    longer = Sequence("c", list(range(9)), SamplingParams())
    assert bm.claim_cached_prefix(longer) == 8


# ---- the engine (default model, float32) ------------------------------------------------------

SYSTEM = ("You are a careful assistant for a team that runs language models on servers with large "
          "idle CPUs. Answer briefly, cite the settings you change, and never invent numbers. ")


def shared_prefix(engine, num_tokens: int) -> list[int]:
    ids = engine.tokenize(SYSTEM * 8)
    assert len(ids) >= num_tokens
    return ids[:num_tokens]


@pytest.fixture(scope="module")
def engine_uncached():
    from runtime.engine import LLMEngine
    engine = LLMEngine(enforce_eager=True, dtype="float32", device="cpu", kv_cache_memory="256MiB", enable_prefix_caching=False,
                       quantization="none")
    yield engine
    engine.close()


def run_one(engine, generate, prompt, params) -> tuple[list[int], int]:
    """(output ids, prompt tokens the target computed for it)."""
    before = engine.stats.num_prompt_tokens_computed
    out, = generate(engine, [prompt], params)
    return out, engine.stats.num_prompt_tokens_computed - before


@pytest.mark.parametrize("speculator", ["none", "lookahead"])
def test_shared_prefix_computes_only_the_suffix(engine_f32, engine_uncached, generate, speculator):
    """Two requests share a 200-token prefix: the second computes only what follows the
    prefix's last full block, and its greedy output (with or without speculation) equals a
    run with caching off."""
    bs = engine_f32.config.block_size
    prefix = shared_prefix(engine_f32, 200)
    first = prefix + engine_f32.tokenize(f" ({speculator}) Question: what is a KV cache?")
    second = prefix + engine_f32.tokenize(f" ({speculator}) Why speculate on the CPU?")
    greedy = SamplingParams(max_tokens=24, temperature=0, speculator=speculator)
    run_one(engine_f32, generate, first, greedy)
    hits_before = engine_f32.stats.num_cached_prompt_tokens
    out, computed = run_one(engine_f32, generate, second, greedy)
    assert engine_f32.stats.num_cached_prompt_tokens - hits_before == 200 // bs * bs
    assert computed == len(second) - 200 // bs * bs
    reference, computed_uncached = run_one(engine_uncached, generate, second,
                                           SamplingParams(max_tokens=24, temperature=0))
    assert computed_uncached == len(second)
    assert out == reference


def test_same_prompt_twice_samples_the_same(engine_f32, engine_uncached, generate):
    """A seeded sampled request served from the cache draws what it draws uncached."""
    prompt = shared_prefix(engine_f32, 150)
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7)
    first, _ = run_one(engine_f32, generate, prompt, params)
    again, computed = run_one(engine_f32, generate, prompt, params)
    assert computed < 16
    assert first == again == run_one(engine_uncached, generate, prompt, params)[0]


def test_eviction_under_a_tiny_pool_keeps_outputs_and_blocks(generate):
    """A pool of a few blocks, many requests sharing prefixes, preemption and eviction:
    outputs equal caching off, and afterwards every block is free, none counted twice."""
    from runtime.engine import LLMEngine

    def engine(caching: bool):
        return LLMEngine(enforce_eager=True, dtype="float32", device="cpu", kv_cache_memory=24 * 16 * 46080, max_num_seqs=4,
                         enable_prefix_caching=caching)

    cached, uncached = engine(True), engine(False)
    assert cached.block_manager.num_blocks == 24
    prefix = shared_prefix(cached, 120)
    prompts = [prefix[:rng_len] + cached.tokenize(f" Topic {i}: batching.") for i, rng_len in
               enumerate([120, 120, 70, 120, 40, 100, 120, 70])]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outputs = generate(cached, prompts, params)
    assert outputs == generate(uncached, prompts, params)
    bm = cached.block_manager
    assert cached.stats.num_preemptions > 0 and cached.stats.num_cached_prompt_tokens > 0
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    assert len(bm.free_block_ids) + len(bm.evictable) == bm.num_blocks
    assert len(set(bm.free_block_ids) | set(bm.evictable)) == bm.num_blocks
    assert not cached.scheduler.has_unfinished and not cached.requests


def test_eagle_requests_do_not_read_the_cache():
    """A proposer that reads the target's features of every token (EAGLE) needs them
    computed: such sequences take nothing from the cache."""
    from speculators.ngram import NGramProposer
    from tests.helpers import new_engine, toy_speculator

    class FeatureReader(NGramProposer):
        needs_features = True

    engine = new_engine()
    name = toy_speculator("feature-reader", FeatureReader())
    generate_warm = engine.add_request(shared_prefix(engine, 40), SamplingParams(max_tokens=1))
    while engine.has_unfinished:  # the prefix is in the cache now
        engine.step()
    rid = engine.add_request(shared_prefix(engine, 40), SamplingParams(max_tokens=1, speculator=name))
    seq: Sequence = engine.requests[rid].seq
    assert generate_warm != rid and not seq.reads_prefix_cache
    assert engine.block_manager.claim_cached_prefix(seq) == 0
    engine.abort(rid)
    engine.close()
