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
from runtime.models.cpu_kernels import cpu_kernels_available, has_vector_kernel
from runtime.models.decoder import DecoderModel
from runtime.models.quant_linear import NO_GEMM, DequantizedLinear, Int4Linear, Int8Linear, make_linear
from runtime.models.quantized_weight import quantize_int4, quantize_int8
from runtime.models.tensor_parallel import (VOCAB_UNIT, TPGroup, check_divisible, shard_model, sharded_config,
                                            vocab_range)

CPU = torch.device("cpu")
QUANTIZED_LAYERS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
needs_kernel = pytest.mark.skipif(not cpu_kernels_available(), reason="the CPU kernel did not build here")

TINY = {
    "llama": dict(num_heads=4, num_kv_heads=2, attention_bias=False, tie_word_embeddings=True),
    "qwen2": dict(num_heads=4, num_kv_heads=1, attention_bias=True, tie_word_embeddings=False),
    "mistral": dict(num_heads=4, num_kv_heads=4, attention_bias=False, tie_word_embeddings=False),
}


def tiny_model(kind: str, vocab_size: int = 301, intermediate_size: int = 96) -> DecoderModel:
    cfg = ModelConfig(architecture=kind, vocab_size=vocab_size, hidden_size=64, intermediate_size=intermediate_size,
                      num_layers=2, head_dim=16, max_position_embeddings=64, **TINY[kind])
    torch.manual_seed(0)
    model = DecoderModel(cfg).float().eval().requires_grad_(False)
    for p in model.parameters():  # biases too: the default init leaves some at zero
        p.data.normal_(0, 0.2)
    return model


def tiny_quantized_model(kind: str, bits: int) -> DecoderModel:
    """A tiny model in bf16 whose linear layers (LM head included) hold int4 (group 32) or int8
    weights in heterospec_cpu.quant_linear's blocked layout; shapes that split in 2 along its
    blocks (16 outputs, 32 inputs): vocabulary 320, MLP 128."""
    model = tiny_model(kind, vocab_size=320, intermediate_size=128).to(torch.bfloat16)
    quantize = quantize_int4 if bits == 4 else quantize_int8
    for path in ["lm_head"] + [f"layers.{i}.{name}" for i in range(2) for name in QUANTIZED_LAYERS]:
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        old = getattr(parent, attr)
        setattr(parent, attr, make_linear(quantize(old.weight.float(), "test"), old.bias, torch.bfloat16, CPU))
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
        elif kind.endswith("-quantized"):
            model = tiny_quantized_model(kind.split("-")[0], bits=int(kind.split("-")[1][3:]))
        else:
            model = tiny_model(kind)
        ids = torch.tensor([3, 17, 250, 42, 7, 99, 1, 300, 12, 5])
        reference = logits_of(model, ids).float()
        shard_model(model, TPGroup(rank, world))
        got = logits_of(model, ids).float()
        assert got.shape == reference.shape
        if model.dtype == torch.float32:
            torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)
        else:  # bf16: the row-parallel layers' partial sums are rounded to bf16 before they are summed
            assert (got - reference).abs().max() < 0.02 * reference.abs().max(), (got - reference).abs().max()
            assert (got.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9
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


@needs_kernel
@pytest.mark.parametrize("kind", ["llama-int4-quantized", "qwen2-int8-quantized"])
def test_quantized_tp2_matches_the_unsharded_quantized_model(kind, tmp_path):
    """bf16 with the blocked int4 / int8 kernel in every linear layer: each rank keeps its
    blocks of the quantized weights; logits within bf16's rounding of the unsharded model's."""
    run_ranks(2, kind, tmp_path)


def split_layers(with_bias: bool = True) -> dict:
    """Each quantized layer kind over one weight [96, 256], by kernel."""
    torch.manual_seed(0)
    w, bias = torch.randn(96, 256) * 0.05, torch.randn(96) * 0.1 if with_bias else None
    int4, int8 = quantize_int4(w, "x"), quantize_int8(w, "x")
    layers = {"int8 row-major": Int8Linear(int8, bias, torch.bfloat16, CPU, many_rows=None),
              "int4 float32": DequantizedLinear(int4, bias, torch.float32, CPU)}
    if has_vector_kernel():  # where the layers take the blocked kernel
        layers["int4 blocked"] = Int4Linear(int4, bias, torch.bfloat16, CPU, many_rows=NO_GEMM)
        layers["int4 blocked, bf16 GEMM"] = Int4Linear(int4, bias, torch.bfloat16, CPU, many_rows=0)
        layers["int8 blocked"] = Int8Linear(int8, bias, torch.bfloat16, CPU, many_rows=NO_GEMM)
    return layers


@pytest.mark.parametrize("name", list(split_layers()))
def test_quantized_layers_keep_exactly_their_rows_and_columns(name):
    """Rows (column-parallel, bias included) and input columns (row-parallel, no bias): the
    weight the kernel computes is the full layer's, cut."""
    full, rows = split_layers()[name].dequantize(), split_layers()[name]  # [96, 256]
    rows.keep_rows([(16, 48), (64, 96)])  # q and v of a fused qkv, say
    assert torch.equal(rows.dequantize(), torch.cat([full[16:48], full[64:96]]))
    assert rows(torch.randn(3, 256).to(rows.dtype)).shape == (3, 64)
    full, columns = split_layers(with_bias=False)[name].dequantize(), split_layers(with_bias=False)[name]
    columns.keep_columns(64, 192)
    assert torch.equal(columns.dequantize(), full[:, 64:192])
    assert columns(torch.randn(3, 128).to(columns.dtype)).shape == (3, 96)


def test_quantized_splits_that_cut_a_block_or_a_group_are_refused():
    layers = split_layers()
    with pytest.raises(ValueError, match="cannot be split"):
        Int4Linear(quantize_int4(torch.randn(96, 256), "x"), None, torch.bfloat16, CPU, many_rows=None).keep_rows(
            [(0, 48)])
    if "int4 blocked" in layers:
        with pytest.raises(ValueError, match="whole blocks of 16"):
            layers["int4 blocked"].keep_rows([(0, 40)])
        with pytest.raises(ValueError, match="whole groups of 32"):
            layers["int4 blocked"].keep_columns(0, 48)
    with pytest.raises(ValueError, match="whole groups of 32"):
        layers["int4 float32"].keep_columns(16, 48)


def test_counts_that_do_not_divide_are_refused_naming_them():
    smollm = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64)
    with pytest.raises(ValueError, match="9 attention heads, 3 KV heads, intermediate size 1536"):
        check_divisible(smollm, 2)
    assert sharded_config(smollm, 3).num_heads == 3 and sharded_config(smollm, 3).num_kv_heads == 1
    with pytest.raises(ValueError, match="not prepacked"):
        model = tiny_model("llama")
        model.lm_head = torch.nn.Identity()
        shard_model(model, TPGroup(0, 2))


def test_vocab_ranges_tile_the_vocabulary():
    for vocab, world in [(301, 2), (49152, 3), (10, 4)]:
        ranges = [vocab_range(vocab, TPGroup(r, world)) for r in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == vocab
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all(s % VOCAB_UNIT == 0 or s == vocab for s, _ in ranges)  # whole blocks of a quantized head
        assert max(e - s for s, e in ranges) - min(e - s for s, e in ranges) < 2 * VOCAB_UNIT


def test_tp1_changes_nothing():
    model = tiny_model("llama")
    before = copy.deepcopy(model)
    shard_model(model, TPGroup(0, 1))
    ids = torch.tensor([1, 2, 3])
    torch.testing.assert_close(logits_of(model, ids), logits_of(before, ids), rtol=0, atol=0)
