"""Tensor-parallel sharding of the decoder (runtime.models.tensor_parallel) against the
unsharded model: N processes over gloo on this CPU (one thread each) each keep their
shard, run the same tokens, and must give the unsharded model's logits in float32.
Tiny random Llama (GQA), Qwen2 (q/k/v biases, one KV head replicated on both ranks) and
Mistral (as many KV heads as heads) models at TP=2, and the default model at TP=3 (its 9
heads and 3 KV heads do not split in 2: that is refused)."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.models.config import ModelConfig
from runtime.models.decoder import DecoderModel
from runtime.models.tensor_parallel import TPGroup, check_divisible, shard_model, sharded_config, vocab_range

TINY = {
    "llama": dict(num_heads=4, num_kv_heads=2, attention_bias=False, tie_word_embeddings=True),
    "qwen2": dict(num_heads=4, num_kv_heads=1, attention_bias=True, tie_word_embeddings=False),
    "mistral": dict(num_heads=4, num_kv_heads=4, attention_bias=False, tie_word_embeddings=False),
}


def tiny_model(kind: str) -> DecoderModel:
    cfg = ModelConfig(architecture=kind, vocab_size=301, hidden_size=64, intermediate_size=96, num_layers=2,
                      head_dim=16, max_position_embeddings=64, **TINY[kind])
    torch.manual_seed(0)
    model = DecoderModel(cfg).float().eval().requires_grad_(False)
    for p in model.parameters():  # biases too: the default init leaves some at zero
        p.data.normal_(0, 0.2)
    return model


def causal_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense causal attention of one sequence: q [T, Hq, D], k, v [T, Hkv, D] -> [T, Hq, D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(q.shape[-1])  # [H, T, T]
    scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


def logits_of(model: DecoderModel, ids: torch.Tensor) -> torch.Tensor:
    hidden = model(ids, torch.arange(len(ids)), causal_attention)  # [T, H]
    return model.compute_logits(hidden)  # [T, V]


def _rank_main(rank: int, world: int, init: str, kind: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        if kind == "default":
            from runtime.models.loader import DEFAULT_MODEL, load_model
            model = load_model(DEFAULT_MODEL, "float32", torch.device("cpu"), "none")[0]
        else:
            model = tiny_model(kind)
        ids = torch.tensor([3, 17, 250, 42, 7, 99, 1, 300, 12, 5])
        reference = logits_of(model, ids)
        shard_model(model, TPGroup(rank, world))
        got = logits_of(model, ids)
        assert got.shape == reference.shape
        torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, kind: str, tmp_path) -> None:
    mp.start_processes(_rank_main, args=(world, f"file://{tmp_path}/rendezvous", kind), nprocs=world,
                       join=True, start_method="spawn")


@pytest.mark.parametrize("kind", sorted(TINY))
def test_tp2_equals_the_unsharded_model(kind, tmp_path):
    run_ranks(2, kind, tmp_path)


def test_the_default_model_at_tp3_equals_the_unsharded_model(tmp_path):
    run_ranks(3, "default", tmp_path)


def test_counts_that_do_not_divide_are_refused_naming_them():
    smollm = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64)
    with pytest.raises(ValueError, match="9 attention heads, 3 KV heads, intermediate size 1536"):
        check_divisible(smollm, 2)
    assert sharded_config(smollm, 3).num_heads == 3 and sharded_config(smollm, 3).num_kv_heads == 1
    with pytest.raises(ValueError, match="float row-major"):
        model = tiny_model("llama")
        model.lm_head = torch.nn.Identity()
        shard_model(model, TPGroup(0, 2))


def test_vocab_ranges_tile_the_vocabulary():
    for vocab, world in [(301, 2), (49152, 3), (10, 4)]:
        ranges = [vocab_range(vocab, TPGroup(r, world)) for r in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == vocab
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert max(e - s for s, e in ranges) - min(e - s for s, e in ranges) <= 1


def test_tp1_changes_nothing():
    model = tiny_model("llama")
    before = copy.deepcopy(model)
    shard_model(model, TPGroup(0, 1))
    ids = torch.tensor([1, 2, 3])
    torch.testing.assert_close(logits_of(model, ids), logits_of(before, ids), rtol=0, atol=0)
