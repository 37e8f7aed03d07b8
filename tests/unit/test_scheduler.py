"""Scheduler: token budget, first come first served, chunked prefill, max_num_seqs and
preemption by recomputation; unit tests on fake sequences, then the real engine with a
KV pool of a few blocks against the same engine with a large pool."""
from __future__ import annotations

import random

import pytest
import torch

from runtime.block_manager import BlockManager
from runtime.sampling_params import SamplingParams
from runtime.scheduler import Scheduler
from runtime.sequence import Sequence, SequenceStatus


def make_seq(prompt_len: int, max_tokens: int = 4, name: str = "s") -> Sequence:
    return Sequence(name, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens))


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget)


def step(sched: Scheduler, finished: list | None = None):
    """Schedule, then do what the engine does with the result (with a fake sampled token)."""
    batch = sched.schedule()
    bm = sched.block_manager
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        assert n >= 1
        assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens + n, "no slot for a new token"
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, "length")
                if finished is not None:
                    finished.append(seq)
    return batch


def test_chunked_prefill_splits_a_long_prompt():
    sched = make_scheduler(budget=16)
    seq = make_seq(50, max_tokens=2)
    sched.add(seq)
    chunks = [step(sched).num_new_tokens for _ in range(5)]
    assert chunks == [[16], [16], [16], [2], [1]]
    assert seq.is_finished and seq.num_output_tokens == 2
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_running_sequences_come_before_waiting_ones():
    sched = make_scheduler(budget=4)
    running = [make_seq(2, max_tokens=10, name=f"r{i}") for i in range(3)]
    for seq in running:
        sched.add(seq)
    step(sched)
    step(sched)  # all three prefilled (2 + 2 tokens, then the third's 2 with 2 decodes)
    newcomer = make_seq(10, name="new")
    sched.add(newcomer)
    batch = step(sched)
    assert batch.seqs[:3] == running and batch.num_new_tokens[:3] == [1, 1, 1]
    assert batch.seqs[3:] == [newcomer] and batch.num_new_tokens[3:] == [1]  # what the budget leaves


def test_first_come_first_served():
    sched = make_scheduler(max_num_seqs=2, budget=1000)
    seqs = [make_seq(3 + i, max_tokens=3, name=f"s{i}") for i in range(6)]
    for seq in seqs:
        sched.add(seq)
    first_scheduled, finished = [], []
    while sched.has_unfinished:
        for seq in step(sched, finished).seqs:
            if seq not in first_scheduled:
                first_scheduled.append(seq)
    assert first_scheduled == seqs
    assert finished == seqs


def test_no_overtaking_when_the_head_of_the_queue_does_not_fit():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=100)
    holder, big, small = make_seq(12, max_tokens=100, name="holder"), make_seq(8, name="big"), make_seq(2, name="small")
    sched.add(holder)
    step(sched)  # holder takes 3 of the 4 blocks
    sched.add(big)
    sched.add(small)  # would fit in the last block, but big came first
    batch = step(sched)
    assert batch.seqs == [holder]
    assert list(sched.waiting) == [big, small]


def test_max_num_seqs():
    sched = make_scheduler(max_num_seqs=3, budget=1000)
    for i in range(7):
        sched.add(make_seq(5, max_tokens=4, name=f"s{i}"))
    while sched.has_unfinished:
        batch = step(sched)
        assert len(batch.seqs) <= 3 and len(sched.running) <= 3


def test_preempts_the_newest_running_sequence():
    sched = make_scheduler(num_blocks=6, block_size=4, budget=100)
    a, b, c = (make_seq(8, max_tokens=10, name=n) for n in "abc")
    for seq in (a, b, c):
        sched.add(seq)
    step(sched)  # 3 x 2 blocks: the pool is full, and every decode now needs a third block
    assert sched.block_manager.num_free_blocks == 0
    batch = step(sched)
    assert batch.seqs == [a, b] and batch.num_preempted == 1
    assert c.status is SequenceStatus.WAITING and list(sched.waiting) == [c]
    assert c.block_table == [] and c.num_computed_tokens == 0 and c.metrics.num_preemptions == 1
    assert c.token_ids[8:] == [7]  # its sampled token is kept, to be recomputed


def test_preempts_itself_when_it_is_the_newest():
    sched = make_scheduler(num_blocks=3, block_size=4, budget=100)
    a, b = make_seq(4, max_tokens=10, name="a"), make_seq(8, max_tokens=10, name="b")
    sched.add(a)
    sched.add(b)
    step(sched)  # a: 1 block, b: 2 blocks, none left
    batch = step(sched)  # a needs a second block: b goes
    assert batch.seqs == [a] and batch.num_preempted == 1 and list(sched.waiting) == [b]


def test_finish_returns_blocks_of_running_and_waiting_sequences():
    sched = make_scheduler(budget=8)
    a, b = make_seq(20, name="a"), make_seq(20, name="b")
    sched.add(a)
    sched.add(b)
    step(sched)  # a got a chunk; b waits (no budget left)
    assert a.status is SequenceStatus.RUNNING and b.status is SequenceStatus.WAITING
    sched.finish(a, "abort")
    sched.finish(b, "abort")
    assert not sched.has_unfinished
    assert a.finish_reason == b.finish_reason == "abort"
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


@pytest.mark.parametrize("seed", range(4))
def test_random_workload(seed):
    """Random arrivals on a small pool: budget, max_num_seqs and slots hold at every step,
    nothing is lost, and the pool is whole at the end."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    num_blocks = rng.randint(8, 40)
    capacity = num_blocks * block_size
    budget, max_num_seqs = rng.randint(1, 64), rng.randint(1, 8)
    sched = Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget)
    seqs, finished, preempted = [], [], 0
    for i in range(40):
        prompt_len = rng.randint(1, capacity // 2)
        seqs.append(make_seq(prompt_len, max_tokens=rng.randint(1, capacity - prompt_len), name=f"s{i}"))
    pending = list(seqs)
    for _ in range(100_000):
        if not (pending or sched.has_unfinished):
            break
        for _ in range(rng.randint(0, 2)):
            if pending:
                sched.add(pending.pop(0))
        batch = step(sched, finished)
        preempted += batch.num_preempted
        assert batch.num_tokens <= budget
        assert len(batch.seqs) == len(set(map(id, batch.seqs))) <= max_num_seqs
        assert len(sched.running) <= max_num_seqs
        used = sum(len(s.block_table) for s in sched.running)
        assert used + sched.block_manager.num_free_blocks == num_blocks
        assert all(not s.block_table for s in sched.waiting)
    else:
        pytest.fail("the scheduler stopped making progress")
    assert sorted(map(id, finished)) == sorted(map(id, seqs))
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert sched.block_manager.num_free_blocks == num_blocks


# ---- the engine on a KV pool of a few blocks -------------------------------------------------

PREEMPTION_PROMPTS = [
    "The three primary colors are",
    "Write a short poem about the sea:",
    "Here is a list of the planets of the solar system, in order from the sun: Mercury,",
    "import numpy as np\nimport torch\n\ndef softmax(x):",
]


def test_tiny_pool_preempts_and_matches_a_large_pool(engine_f32, generate):
    from runtime.engine import LLMEngine
    from target_gpu.kv_cache import bytes_per_block
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = generate(engine_f32, PREEMPTION_PROMPTS, params)
    num_blocks, block_size = 6, 16
    per_block = bytes_per_block(engine_f32.model_config, block_size, torch.float32)
    # a budget of 16 also chunks the recomputation of preempted sequences (prompt + output so far)
    engine = LLMEngine(enforce_eager=True, dtype="float32", device="cpu", block_size=block_size, max_num_batched_tokens=16,
                       kv_cache_memory=num_blocks * per_block, quantization="none")
    assert engine.block_manager.num_blocks == num_blocks
    assert max(len(engine.tokenize(p)) for p in PREEMPTION_PROMPTS) + 40 <= engine.max_model_len
    assert generate(engine, PREEMPTION_PROMPTS, params) == expected
    assert engine.stats.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting
