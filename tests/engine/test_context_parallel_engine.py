"""The engine with context-parallel prefill (target_gpu.context_parallel): prompt chunks of
at least --cp-min-tokens go around a ring of N processes, the rest of the step and decoding
run in rank 0. Greedy in float32 on the default model against the single-process engine,
64 tokens:

- CP=2 with chunks of 32 tokens and cp_min_tokens=20: a prompt's first chunk goes around the
  ring, a second full chunk too (attending to the first, read back from the paged cache),
  and a short last chunk runs as usual: the three kinds mixed in one prefill, with other
  prompts' chunks and decoding beside them;
- CP=2 x TP=2 (a mesh of four ranks: two rings of two, two tensor groups of two) on tiny
  random Qwen2 (GQA: one KV head a shard) and Mistral models, Mistral's sliding window
  shorter than a chunk (the second chunk sees only the window's part of the first);
- a worker killed before a ring chunk: the step fails naming the rank, nothing hangs, the KV
  blocks come back; close() leaves no worker behind."""
from __future__ import annotations

import os
import signal
import time

import pytest

from runtime.config import EngineConfig
from target_gpu.tensor_parallel import TPWorkerError
from tests.helpers import greedy, new_engine, save_tiny_model

LONG = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden screw press. Within fifty years presses were working in "
        "more than two hundred cities across Europe. The printed book changed how knowledge spread, and within a "
        "century it had reshaped science, religion and politics. Summarize this in one sentence:")
PROMPTS = [LONG, LONG[:170] + " What came next?", "The capital of France is", "def fibonacci(n):\n    "]
CP = dict(context_parallel_size=2, cp_min_tokens=20, max_num_batched_tokens=32)


def test_cp2_equals_one_process_with_ring_and_plain_chunks_mixed(engine_f32, generate):
    engine = new_engine(**CP)
    workers = list(engine.runner.workers.values())
    try:
        lengths = [len(engine.tokenize(p)) for p in PROMPTS]
        assert 64 < lengths[0] < 84 and 32 < lengths[1] < 52, lengths  # a short last chunk: not a ring one
        assert generate(engine, PROMPTS, greedy(64)) == generate(engine_f32, PROMPTS, greedy(64))
        chunks = [(c.start, c.tokens) for c in engine.runner.ring_chunks]
        assert chunks[:2] == [(0, 32), (32, 32)], chunks  # the second one attends to the first, from the cache
    finally:
        engine.close()
    assert not any(w.is_alive() for w in workers)


@pytest.mark.parametrize("kind, window", [("qwen2", None), ("mistral", 16)])
def test_cp2_by_tp2_equals_one_process(kind, window, engine_f32, generate, tmp_path):
    save_tiny_model(kind, tmp_path, engine_f32.tokenizer, sliding_window=window)
    single = new_engine(model=str(tmp_path))
    try:
        expected = generate(single, PROMPTS, greedy(64))
    finally:
        single.close()
    engine = new_engine(model=str(tmp_path), tensor_parallel_size=2, **CP)
    workers = list(engine.runner.workers.values())
    try:
        assert len(workers) == 3 and engine.runner.config.num_kv_heads == 1
        assert generate(engine, PROMPTS, greedy(64)) == expected
        chunks = [(c.start, c.tokens) for c in engine.runner.ring_chunks]
        assert chunks[:2] == [(0, 32), (32, 32)], chunks
    finally:
        engine.close()
    assert not any(w.is_alive() for w in workers)


def test_a_killed_ring_worker_fails_the_step_naming_it():
    engine = new_engine(**CP)
    worker = engine.runner.workers[1]
    try:
        rid = engine.add_request(LONG, greedy(8))
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=5)
        start = time.monotonic()
        with pytest.raises(TPWorkerError, match=r"context-parallel rank 1 \(pid \d+\) was killed by SIGKILL"):
            engine.step()
        assert time.monotonic() - start < 5
        engine.abort(rid)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.close()
    assert not worker.is_alive()


def test_context_parallel_settings_are_checked():
    with pytest.raises(ValueError, match="one node's CPU"):
        EngineConfig(context_parallel_size=2, tensor_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match=">= 1"):
        EngineConfig(context_parallel_size=2, cp_min_tokens=0)
