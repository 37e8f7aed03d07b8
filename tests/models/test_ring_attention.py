"""Context-parallel prefill with ring attention (target_gpu.ring_attention) against the
single-rank model: N processes over gloo (one thread each) each run their zig-zag slice of
one prompt, passing K/V around the ring, and must give the single-rank logits (float32,
1e-4) and K/V at their positions. Prompt lengths that do not divide by N, GQA (tiny Llama
4/2 heads, Qwen2 with one KV head), a Mistral sliding window shorter than the prompt, and a
rank that dies mid-ring."""
from __future__ import annotations

import dataclasses
import math
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from target_gpu.ring_attention import (ContextParallelError, RingAttention, block_attention, merge, ring_prefill,
                                       window_start, zigzag_slices)
from tests.models.test_tensor_parallel import tiny_model

PROMPT_LEN = 37  # divides by neither 2 nor 3
SPLIT = 15  # a second chunk starts here
WINDOW = 8


def dense_attention(window: int | None = None, record: dict | None = None):
    """Dense causal attention of one whole sequence (q, k, v [T, H, D]), optionally windowed;
    records each layer's (k, v) into `record`."""
    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if record is not None:
            record[layer] = (k, v)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(q.shape[-1])  # [H, T, T]
        pos = torch.arange(q.shape[0])
        visible = pos[None, :] <= pos[:, None]
        if window is not None:
            visible &= pos[:, None] - pos[None, :] < window
        return torch.einsum("hts,shd->thd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)
    return attention


def model_of(kind: str):
    """A tiny random model; Mistral's with a sliding window shorter than the prompt."""
    model = tiny_model(kind)
    if kind == "mistral":
        model.config = dataclasses.replace(model.config, sliding_window=WINDOW)
    return model


def test_blocks_merged_by_log_sum_exp_equal_one_softmax():
    """Keys in three blocks, out of order, one that some queries see nothing of; windowed too."""
    torch.manual_seed(0)
    q, k, v = torch.randn(10, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    pos = torch.arange(10)
    for window in (None, 3):
        dense = dense_attention(window)(0, q, k, v)
        out = lse = None
        for keys in (torch.arange(6, 10), torch.arange(0, 3), torch.arange(3, 6)):
            part = block_attention(q, pos, k[keys], v[keys], pos[keys], window)
            out, lse = part if out is None else merge(out, lse, *part)
        torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length, world", [(37, 2), (37, 3), (5, 3), (64, 4)])
def test_zigzag_slices_cover_the_prompt_once_and_balance_causal_work(length, world):
    slices = zigzag_slices(length, world)
    assert torch.equal(torch.cat(slices).sort().values, torch.arange(length))
    work = [int((s + 1).sum()) for s in slices]  # keys each rank's queries see under the causal mask
    if length >= 8 * world:
        assert max(work) / min(work) < 1.3


def _rank_main(rank: int, world: int, init: str, kind: str, die_at_layer: int | None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=30))
    try:
        model = model_of(kind)
        window = model.config.sliding_window
        ids = torch.randint(0, model.config.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))
        if die_at_layer is not None:
            _run_until_a_rank_dies(model, ids, rank, world, die_at_layer)
            return
        recorded: dict = {}
        reference = model.compute_logits(model(ids, torch.arange(PROMPT_LEN), dense_attention(window, recorded)))
        hidden, slices, ring = ring_prefill(model, ids, rank, world)
        positions = slices[rank]
        torch.testing.assert_close(model.compute_logits(hidden), reference[positions], rtol=1e-4, atol=1e-4)
        for layer, (k, v) in recorded.items():
            torch.testing.assert_close(ring.kv[layer][0], k[positions], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ring.kv[layer][1], v[positions], rtol=1e-5, atol=1e-5)
        # a second chunk after SPLIT tokens, attending to what it sees of the first (all of it, or the window's part)
        seen = torch.arange(window_start(SPLIT, window), SPLIT)
        prefix = torch.stack([torch.stack([k[seen], v[seen]]) for k, v in recorded.values()])  # [layers, 2, P, Hkv, D]
        hidden, slices, _ = ring_prefill(model, ids[SPLIT:], rank, world, start=SPLIT, prefix=prefix)
        torch.testing.assert_close(model.compute_logits(hidden), reference[SPLIT + slices[rank]], rtol=1e-4, atol=1e-4)
    finally:
        if die_at_layer is None:
            dist.destroy_process_group()


def _run_until_a_rank_dies(model, ids, rank: int, world: int, die_at_layer: int) -> None:
    """Rank 1 exits at `die_at_layer`; rank 0 must raise ContextParallelError, and soon."""
    if rank == 1:
        original = RingAttention.__call__

        def dying(self, layer, q, k, v):
            if layer == die_at_layer:
                os._exit(3)
            return original(self, layer, q, k, v)
        RingAttention.__call__ = dying
        ring_prefill(model, ids, rank, world)
        return
    start = time.monotonic()
    with pytest.raises(ContextParallelError, match=f"layer {die_at_layer}.*rank 1"):
        ring_prefill(model, ids, rank, world)
    assert time.monotonic() - start < 25
    os._exit(0)  # the group's other member is gone: skip its teardown


def run_ranks(world: int, kind: str, tmp_path, die_at_layer: int | None = None):
    return mp.start_processes(_rank_main, args=(world, f"file://{tmp_path}/rendezvous", kind, die_at_layer),
                              nprocs=world, join=die_at_layer is None, start_method="spawn")


@pytest.mark.parametrize("kind, world", [("llama", 2), ("qwen2", 3), ("mistral", 2)])
def test_ring_prefill_equals_single_rank_prefill(kind, world, tmp_path):
    run_ranks(world, kind, tmp_path)


def test_a_rank_that_dies_mid_ring_is_an_error_not_a_hang(tmp_path):
    context = run_ranks(2, "llama", tmp_path, die_at_layer=1)
    deadline = time.monotonic() + 60
    while not all(p.exitcode is not None for p in context.processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    codes = [p.exitcode for p in context.processes]
    for p in context.processes:
        if p.exitcode is None:
            p.kill()
    assert codes == [0, 3], codes  # rank 0 raised ContextParallelError in time (else its assertion exits 1)
