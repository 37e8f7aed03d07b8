"""TritonAttentionBackend against the PyTorch reference (TorchAttentionBackend, the oracle)
and against naive float64 attention (tests/kernels/test_attention.py): decodes, random token trees,
causal prefill chunks and all of them in one step, GQA ratios 1-3, scattered block tables.

Without a CUDA device the kernels run in Triton's CPU interpreter, in float32 and float16
(its tl.dot is wrong on bf16 operands); bf16 and larger shapes run on a GPU only. Also:
the kernels compile for sm_90 without a GPU, and the backend's choice through
EngineConfig, the CLIs and ModelRunner.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

CUDA = torch.cuda.is_available()
with pytest.MonkeyPatch.context() as mp:  # TRITON_INTERPRET=1 while triton.language is imported (without CUDA):
    if not CUDA:  # its own helpers (tl.zeros, tl.max) are jitted then, for the interpreter or not
        assert "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1", \
            "triton was imported before this module could turn its interpreter on"
        mp.setenv("TRITON_INTERPRET", "1")
    triton = pytest.importorskip("triton")

from runtime.config import EngineConfig  # noqa: E402
from runtime.models.config import ModelConfig  # noqa: E402
from runtime.models.decoder import DecoderModel  # noqa: E402
from runtime.draft_tree import DraftTree  # noqa: E402
from target_gpu import triton_attention  # noqa: E402
from target_gpu.attention import AttentionMetadata, SeqAttentionInput, TorchAttentionBackend  # noqa: E402
from target_gpu.kv_cache import KVCache  # noqa: E402
from target_gpu.model_runner import GraphLimits, ModelRunner, make_attention_backend  # noqa: E402
from target_gpu.triton_attention import TritonAttentionBackend  # noqa: E402
from tests.kernels.test_attention import causal_mask, naive_attention, tree_mask  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
ROOT = Path(__file__).resolve().parents[2]
REL_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
HEADS = [(4, 4), (4, 2), (6, 2)]  # (query heads, kv heads): GQA ratios 1, 2, 3
ON_GPU = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (the interpreter's tl.dot is wrong on bf16)")


def _index_squeezed(patch_lang_tensor):
    """Triton 3.4's interpreter turns a loaded scalar (a NumPy array of shape (1,)) into a
    loop bound with int(array), which NumPy >= 2.4 refuses; squeeze it first (the fix
    given in triton-lang/triton#9171)."""
    def patched(tensor, *args):
        patch_lang_tensor(tensor, *args)
        tensor.__index__ = lambda self: int(self.handle.data.squeeze())
    return patched


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    """Without CUDA: Triton's interpreter, fixed for NumPy >= 2.4, while this module's tests
    run. Triton reads TRITON_INTERPRET when a kernel is jitted, and triton_attention jits
    its kernels at first use, so other tests and their subprocesses never see it set."""
    if CUDA:
        yield
        return
    from triton.runtime import interpreter as triton_interpreter
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.setattr(triton_interpreter, "_patch_lang_tensor", _index_squeezed(triton_interpreter._patch_lang_tensor))
        yield


def rel_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.double() - expected).abs().max() / expected.abs().max())


def scattered_tables(seq_lens: list[int], block_size: int, gen: torch.Generator) -> tuple[list[list[int]], int]:
    """Block tables drawn out of order from a pool with 3 spare blocks -> (tables, num_blocks)."""
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in seq_lens:
        nb = -(-n // block_size)
        tables.append(free[:nb])
        free = free[nb:]
    return tables, num_blocks


def check_step(query_lens, context_lens, heads, *, masks=None, block_size=4, head_dim=16, dtype=torch.float32,
               seed=0, num_splits=None):
    """One step over a random paged layout, through both backends on copies of one pool:
    the pools must be equal afterwards (the KV write), and the Triton output close to naive
    float64 attention and to the reference. num_splits: key splits (None: the kernel's choice)."""
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    tables, num_blocks = scattered_tables(seq_lens, block_size, gen)
    cfg = ModelConfig(architecture="llama", vocab_size=8, hidden_size=num_heads * head_dim, intermediate_size=8,
                      num_layers=2, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    caches = [KVCache(cfg, num_blocks, block_size, dtype, DEVICE) for _ in range(2)]
    for i, pool in enumerate(caches[0].k + caches[0].v):  # garbage everywhere, so a wrong gather shows
        pool.copy_(torch.randn(pool.shape, generator=gen))
        (caches[1].k + caches[1].v)[i].copy_(pool)
    before = [t.clone() for t in caches[0].k + caches[0].v]

    inputs, slots, start = [], [], 0
    for i, (c, n) in enumerate(zip(context_lens, query_lens)):
        inputs.append(SeqAttentionInput(start, n, c + n, tables[i], None if masks is None else masks[i]))
        slots.extend(tables[i][p // block_size] * block_size + p % block_size for p in range(c, c + n))
        start += n
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=DEVICE)  # [T]
    # q, k, v as the decoder hands them over: views of one [T, Hq + 2 Hkv, D] tensor
    qkv = torch.randn(start, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    layer, g = 1, num_heads // num_kv_heads
    meta = AttentionMetadata.build(inputs, slot_mapping, block_size, g, DEVICE, for_kernel=True)
    meta.kernel.num_splits = num_splits
    out = TritonAttentionBackend(caches[0]).forward(layer, q, k, v, meta)
    ref_meta = AttentionMetadata.build(inputs, slot_mapping, block_size, g, DEVICE)
    ref = TorchAttentionBackend(caches[1]).forward(layer, q, k, v, ref_meta)

    assert out.shape == q.shape and out.dtype == dtype
    check_kv_write(caches, before, slot_mapping, k, v, layer)
    k_flat, v_flat = (pool[layer].view(-1, num_kv_heads, head_dim).cpu() for pool in (caches[0].k, caches[0].v))
    start = 0
    for i, (c, n) in enumerate(zip(context_lens, query_lens)):
        rows = slice(start, start + n)
        mask = causal_mask(c, n) if masks is None or masks[i] is None else masks[i]
        positions = torch.tensor([tables[i][p // block_size] * block_size + p % block_size for p in range(c + n)])
        expected = naive_attention(q[rows].cpu(), k_flat[positions], v_flat[positions], mask)
        assert rel_error(out[rows].cpu(), expected) < REL_TOLERANCE[dtype], f"sequence {i} (context {c}, query {n})"
        start += n
    assert rel_error(out.cpu(), ref.cpu().double()) < REL_TOLERANCE[dtype], "Triton and the reference differ"


def check_kv_write(caches, before, slot_mapping, k, v, layer):
    """The step's k/v are in their slots of `layer`, and nothing else in either pool changed."""
    triton_pools, reference_pools = caches[0].k + caches[0].v, caches[1].k + caches[1].v
    for a, b in zip(triton_pools, reference_pools):
        assert torch.equal(a, b), "the Triton and reference pools differ after the step"
    num_layers = len(caches[0].k)
    for i, (pool, old) in enumerate(zip(triton_pools, before)):
        flat, old_flat = pool.view(-1, *pool.shape[2:]), old.view(-1, *old.shape[2:])  # [slots, Hkv, D]
        written = torch.zeros(flat.shape[0], dtype=torch.bool, device=flat.device)
        if i % num_layers == layer:
            written[slot_mapping] = True
            assert torch.equal(flat[slot_mapping], k if i < num_layers else v), "new K/V not in their slots"
        assert torch.equal(flat[~written], old_flat[~written]), "a slot outside the step changed"


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_decode_batch(heads, block_size):
    check_step([1] * 6, [0, 1, 3, 4, 17, 40], heads, block_size=block_size)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_tree_batch(heads):
    """Random token trees (each node sees the context and its ancestors) next to a decode."""
    rng = random.Random(7)
    query_lens, context_lens = [1, 5, 8, 17, 3], [12, 20, 0, 6, 9]
    masks = [None] + [tree_mask(c, n, rng) for c, n in zip(context_lens[1:], query_lens[1:])]
    check_step(query_lens, context_lens, heads, masks=masks, seed=2)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_prefill_chunks(heads):
    """Causal chunks, first and later ones; 70 rows take two programs even at G = 1."""
    check_step([37, 70, 5], [0, 9, 33], heads, block_size=16, seed=3)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_mixed_step(heads, block_size):
    """Decodes, trees and prefill chunks in one step, the engine's speculative steady state."""
    rng = random.Random(11)
    query_lens, context_lens = [1, 6, 30, 1, 4, 2], [21, 8, 3, 0, 40, 0]
    masks = [None, tree_mask(8, 6, rng), None, None, tree_mask(40, 4, rng), None]
    check_step(query_lens, context_lens, heads, masks=masks, block_size=block_size, seed=4)


@pytest.mark.parametrize("seed, block_size", list(enumerate([1, 2, 3, 4, 16])))
def test_random_steps(seed, block_size):
    """Random mixes of decodes, trees and chunks; any block size (3 too) works."""
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    query_lens = [rng.choice([1, 1, 3, 9, 24]) for _ in range(n)]
    context_lens = [rng.randint(0, 40) for _ in range(n)]
    masks = [tree_mask(c, q, rng) if rng.random() < 0.4 else None for c, q in zip(context_lens, query_lens)]
    check_step(query_lens, context_lens, HEADS[seed % 3], masks=masks, block_size=block_size, seed=seed)


@pytest.mark.parametrize("head_dim", triton_attention.SUPPORTED_HEAD_DIMS)
def test_head_dims(head_dim):
    rng = random.Random(5)
    check_step([1, 4, 9], [7, 3, 20], (4, 2), masks=[None, tree_mask(3, 4, rng), None], head_dim=head_dim, seed=5)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_fp16(heads):
    """Half precision where the interpreter gets it right (fp16; not bf16)."""
    rng = random.Random(17)
    check_step([1, 5, 20], [9, 4, 0], heads, masks=[None, tree_mask(4, 5, rng), None], dtype=torch.float16, seed=7)


@ON_GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_half_precision_on_gpu(heads, dtype):
    rng = random.Random(13)
    query_lens, context_lens = [1, 6, 100, 1, 4], [300, 8, 3, 0, 40]
    masks = [None, tree_mask(8, 6, rng), None, None, tree_mask(40, 4, rng)]
    for head_dim, block_size in [(64, 16), (128, 16), (128, 4)]:
        check_step(query_lens, context_lens, heads, masks=masks, block_size=block_size, head_dim=head_dim,
                   dtype=dtype, seed=6)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_key_splits(num_splits):
    """Each program's keys cut in parts and merged (flash decoding): decodes, trees and
    chunks, with parts that hold only keys a row may not see, and empty parts (8 splits of
    a short sequence)."""
    rng = random.Random(19)
    query_lens, context_lens = [1, 6, 30, 1, 4, 2], [150, 8, 3, 0, 90, 5]
    masks = [None, tree_mask(8, 6, rng), None, None, tree_mask(90, 4, rng), None]
    check_step(query_lens, context_lens, (6, 2), masks=masks, block_size=16, seed=8, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("window", [5, 16])
def test_sliding_window_matches_the_reference(window, num_splits):
    """Decodes, trees (the engine's [Q, Q] masks over the new tokens) and prefill chunks past a
    window, in one step, against the reference backend's window masks (checked against HF in
    tests/models/test_models.py). In the kernel's pool, the blocks before the key tile of the
    earliest window of a sequence hold NaN: a program that loaded one would show it."""
    heads, block_size, head_dim = (4, 2), 4, 16
    rng, gen = random.Random(23), torch.Generator().manual_seed(9)
    query_lens, context_lens = [1, 5, 30, 1, 4], [40, 21, 3, 7, 50]
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    masks = [None, tree_mask(21, 5, rng)[:, 21:], None, None, tree_mask(50, 4, rng)[:, 50:]]
    tables, num_blocks = scattered_tables(seq_lens, block_size, gen)
    cfg = ModelConfig(architecture="mistral", vocab_size=8, hidden_size=heads[0] * head_dim, intermediate_size=8,
                      num_layers=2, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim)
    caches = [KVCache(cfg, num_blocks, block_size, torch.float32, DEVICE) for _ in range(2)]
    for i, pool in enumerate(caches[0].k + caches[0].v):
        pool.copy_(torch.randn(pool.shape, generator=gen))
        (caches[1].k + caches[1].v)[i].copy_(pool)
        for c, table in zip(context_lens, tables):  # no row's window reaches the tile of keys they are in
            skipped = max(0, c - window + 1) // triton_attention.BLOCK_N * triton_attention.BLOCK_N
            for b in range(skipped // block_size):
                pool[table[b]] = float("nan")
    inputs, slots, start = [], [], 0
    for i, (c, n) in enumerate(zip(context_lens, query_lens)):
        inputs.append(SeqAttentionInput(start, n, c + n, tables[i], masks[i]))
        slots.extend(tables[i][p // block_size] * block_size + p % block_size for p in range(c, c + n))
        start += n
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=DEVICE)
    qkv = torch.randn(start, heads[0] + 2 * heads[1], head_dim, generator=gen).to(DEVICE)
    q, k, v = qkv.split([heads[0], heads[1], heads[1]], dim=1)
    meta = AttentionMetadata.build(inputs, slot_mapping, block_size, 2, DEVICE, for_kernel=True)
    meta.kernel.num_splits = num_splits
    out = TritonAttentionBackend(caches[0], window=window).forward(1, q, k, v, meta)
    ref_meta = AttentionMetadata.build(inputs, slot_mapping, block_size, 2, DEVICE, window=window)
    ref = TorchAttentionBackend(caches[1]).forward(1, q, k, v, ref_meta)
    assert caches[0].k[1].isnan().any()  # some blocks are skipped at either window
    assert rel_error(out.cpu(), ref.cpu().double()) < REL_TOLERANCE[torch.float32]


def test_key_split_choice():
    """Splits only while a step has too few programs for the GPU and its keys are many."""
    choose, target = triton_attention.num_key_splits, triton_attention.TARGET_PROGRAMS
    min_keys = triton_attention.MIN_KEYS_PER_SPLIT
    assert choose(target, 100_000) == 1  # enough programs already
    assert choose(2, min_keys - 1) == 1  # too few keys to cut
    assert choose(2, 3 * min_keys) == 3  # parts of at least MIN_KEYS_PER_SPLIT keys
    assert choose(2, 100_000) == triton_attention.MAX_SPLITS
    assert choose(target // 4, 100_000) == 4  # enough to reach the target


@ON_GPU
def test_long_contexts_split_on_gpu():
    """A batch-1 decode and a small tree over thousands of cached keys, bf16, the kernel's
    own split choice (more than one here)."""
    rng = random.Random(23)
    assert triton_attention.num_key_splits(2 * 2, 4000) > 1
    check_step([1, 5], [4000, 2500], (8, 2), masks=[None, tree_mask(2500, 5, rng)], block_size=16, head_dim=64,
               dtype=torch.bfloat16, seed=9)


def test_mask_must_show_the_whole_context():
    """The kernel masks new tokens only: a mask hiding part of the cached context is refused."""
    mask = causal_mask(4, 2)
    mask[1, 0] = False
    seq = SeqAttentionInput(0, 2, 6, [0, 1], mask)
    with pytest.raises(AssertionError, match="whole cached context"):
        AttentionMetadata.build([seq], torch.zeros(2, dtype=torch.long), 4, 1, torch.device("cpu"), for_kernel=True)


# ---- through ModelRunner ----------------------------------------------------------------------

def tiny_model(num_heads=4, num_kv_heads=2, head_dim=16) -> tuple[DecoderModel, ModelConfig]:
    torch.manual_seed(0)
    cfg = ModelConfig(architecture="llama", vocab_size=50, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    return DecoderModel(cfg).to(DEVICE).eval(), cfg


def test_model_runner_prefill_then_tree():
    """A prompt's prefill beside another's, then a draft tree over one and a decode of the
    other: the Triton runner's logits are the reference runner's."""
    model, cfg = tiny_model()
    runners = [ModelRunner(model, cfg, 16, 4, DEVICE, backend) for backend in ("triton", "torch")]
    assert [r.attention.name for r in runners] == ["triton", "torch"]
    logits = []
    for runner in runners:
        a = SimpleNamespace(token_ids=list(range(1, 20)), num_computed_tokens=0, block_table=[9, 2, 14, 5, 0, 7])
        b = SimpleNamespace(token_ids=list(range(30, 41)), num_computed_tokens=0, block_table=[3, 11, 6, 1])
        first = runner.execute([a, b], [19, 11], [True, True])
        a.num_computed_tokens, b.num_computed_tokens = 19, 11
        a.token_ids.append(7)
        b.token_ids.append(8)
        tree = DraftTree([4, 5, 6, 9], [-1, 0, -1, 1])
        second = runner.execute([a, b], [1, 1], [True, True], trees=[tree, None])
        logits.append(torch.cat([first, second]).cpu())
    assert rel_error(logits[0], logits[1].double()) < 1e-4


@pytest.mark.parametrize("feature_layers, min_split_keys", [((), None), ((1,), 16)],
                         ids=["plain", "feature-layers-and-key-splits"])
def test_graph_steps_are_padded_decode_and_verify_steps(feature_layers, min_split_keys, monkeypatch):
    """The CUDA-graph path (captured on a GPU; run eagerly on the padded buffers here): a
    prefill runs eagerly, then decode and tree-verify steps go through the graph runner at
    padded sizes, with the reference runner's logits and hidden states (with EAGLE-3
    feature layers, graphs made again: the wider hidden states too; with parts of 16 keys,
    every graph splits keys 4 ways, chosen for the 64-token limit); padded tokens write
    only the scratch block: the rest of the pool holds what the reference wrote."""
    splits, choose = [], triton_attention.num_key_splits
    monkeypatch.setattr(triton_attention, "num_key_splits", lambda *a: splits.append(choose(*a)) or splits[-1])
    if min_split_keys:
        monkeypatch.setattr(triton_attention, "MIN_KEYS_PER_SPLIT", min_split_keys)
    model, cfg = tiny_model()
    limits = GraphLimits(max_tokens=16, max_seqs=4, max_model_len=64, capture=CUDA)
    graph_runner = ModelRunner(model, cfg, 16, 4, DEVICE, "triton", limits)
    reference = ModelRunner(model, cfg, 16, 4, DEVICE, "torch")
    for runner in (graph_runner, reference):
        runner.set_feature_layers(feature_layers)
    assert graph_runner.graphs is not None and graph_runner.graphs.sizes[-1] == 16
    assert graph_runner.graphs.feature_layers == feature_layers
    split = 4 if min_split_keys else 1
    assert set(splits) == ({split} if CUDA else set())  # the graphs' forwards, captured (no calls at replay)
    splits.clear()
    graph_calls = []
    run = graph_runner.graphs.run
    graph_runner.graphs.run = lambda *a: graph_calls.append(len(a[0])) or run(*a)
    trees = [[DraftTree([4, 5, 6, 9], [-1, 0, -1, 1]), None],  # 5 + 1 = 6 tokens, padded to 8
             [None, None],  # a plain decode of both: 2 tokens
             [DraftTree([3], [-1]), DraftTree([1, 2, 3, 4, 5, 6, 7, 8], [-1, 0, 1, 2, 3, 4, 5, 6])]]  # 11 -> 16
    outputs = []
    for runner in (graph_runner, reference):
        a = SimpleNamespace(token_ids=list(range(1, 20)), num_computed_tokens=0, block_table=[9, 2, 14, 5, 0, 7, 8])
        b = SimpleNamespace(token_ids=list(range(30, 41)), num_computed_tokens=0, block_table=[3, 11, 6, 1, 4, 10])
        steps = [runner.execute([a, b], [19, 11], [True, True])]
        for step_trees in trees:
            a.num_computed_tokens, b.num_computed_tokens = len(a.token_ids), len(b.token_ids)
            a.token_ids.append(7)
            b.token_ids.append(8)
            logits, hidden = runner.execute([a, b], [1, 1], [True, True], trees=step_trees, return_hidden="all")
            steps += [logits, hidden]
        outputs.append([t.cpu() for t in steps])
    assert graph_calls == [6, 2, 11]
    # eager prefill, then 3 graph steps of 2 layers (run eagerly where nothing was captured)
    assert splits == [1, 1] + ([] if CUDA else [split] * 6)
    assert outputs[0][2].shape[1] == (1 + len(feature_layers)) * cfg.hidden_size
    for ours, theirs in zip(*outputs):
        assert ours.shape == theirs.shape
        assert rel_error(ours, theirs.double()) < 1e-4
    scratch = 16  # the block past the 16 the block manager hands out
    for ours, theirs in zip(graph_runner.kv_cache.k + graph_runner.kv_cache.v,
                            reference.kv_cache.k + reference.kv_cache.v):
        ours, theirs = ours[:scratch].cpu(), theirs[:scratch].cpu()
        assert torch.equal(ours != 0, theirs != 0)  # the same slots written (the pool starts at zero)
        assert torch.allclose(ours, theirs, atol=1e-5)  # padded matmuls may round differently


def test_graphs_only_with_the_triton_backend():
    model, cfg = tiny_model()
    limits = GraphLimits(max_tokens=8, max_seqs=2, max_model_len=32, capture=False)
    assert ModelRunner(model, cfg, 4, 4, DEVICE, "torch", limits).graphs is None


# ---- choosing the backend ---------------------------------------------------------------------

def test_engine_config_and_cli_flag():
    pytest.importorskip("fastapi")  # runtime.serve's (the GPU box has no server packages)
    from runtime.generate import build_parser
    from runtime.serve import engine_config, parse_args

    assert EngineConfig().attention_backend == "auto"
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")
    assert engine_config(parse_args(["--attention-backend", "triton"])).attention_backend == "triton"
    assert engine_config(parse_args([])).attention_backend == "auto"
    args = build_parser().parse_args(["--input", "x", "--output", "y", "--attention-backend", "torch"])
    assert args.attention_backend == "torch"


def test_auto_is_triton_on_cuda_else_torch():
    model, cfg = tiny_model()
    assert ModelRunner(model, cfg, 4, 4, DEVICE, "auto").attention.name == ("triton" if CUDA else "torch")


@pytest.mark.skipif(CUDA, reason="checks the CPU without a GPU")
def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    model, cfg = tiny_model()
    with pytest.raises(ValueError, match="attention backend 'triton' cannot run: it runs on CUDA.*TRITON_INTERPRET"):
        ModelRunner(model, cfg, 4, 4, DEVICE, "triton")


def test_unsupported_head_dim_is_a_clear_error_and_auto_falls_back():
    cfg = ModelConfig(architecture="llama", vocab_size=8, hidden_size=96, intermediate_size=8, num_layers=1,
                      num_heads=1, num_kv_heads=1, head_dim=96)
    cache = KVCache(cfg, 2, 4, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="head_dim"):
        make_attention_backend("triton", cache, DEVICE)
    assert make_attention_backend("auto", cache, DEVICE).name == "torch"


def test_imports_without_triton():
    """Where triton is missing the module imports, and asking for the backend says why it cannot run."""
    code = """if True:
        import sys, torch
        sys.modules["triton"] = None  # import triton -> ImportError
        from runtime.models.config import ModelConfig
        from target_gpu.kv_cache import KVCache
        from target_gpu.triton_attention import TritonAttentionBackend
        cfg = ModelConfig(architecture="llama", vocab_size=8, hidden_size=16, intermediate_size=8, num_layers=1,
                          num_heads=1, num_kv_heads=1, head_dim=16)
        try:
            TritonAttentionBackend(KVCache(cfg, 2, 4, torch.float32, torch.device("cpu")))
        except ValueError as e:
            print(e)
        """
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert "needs the triton package" in result.stdout


# ---- the real compiler, without a GPU -----------------------------------------------------------

ATTENTION_SIGNATURE = {
    **{name: "*{dtype}" for name in ("out_ptr", "part_ptr", "lse_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")},
    **{name: "*i32" for name in ("query_start_ptr", "query_len_ptr", "seq_len_ptr", "block_tables_ptr",
                                 "mask_offset_ptr", "work_seq_ptr", "work_row_ptr")},
    "masks_ptr": "*i8", "scale_log2": "fp32",
    **{name: "i32" for name in ("num_tokens", "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_table")},
}
SPLIT_ATTENTION_SIGNATURE = {**ATTENTION_SIGNATURE, "part_ptr": "*fp32", "lse_ptr": "*fp32"}  # parts in fp32
MERGE_SIGNATURE = {"out_ptr": "*{dtype}", "part_ptr": "*fp32", "lse_ptr": "*fp32",
                   **{name: "i32" for name in ("num_tokens", "stride_ot", "stride_oh")}}
WRITE_KV_SIGNATURE = {
    **{name: "*{dtype}" for name in ("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr")}, "slot_ptr": "*i64",
    **{name: "i32" for name in ("stride_kt", "stride_kh", "stride_vt", "stride_vh")},
}


COMPILE = """if True:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction
    from target_gpu import triton_attention
    for name, signature, constants in {cases!r}:
        source = ASTSource(JITFunction(getattr(triton_attention, name)), signature, constants)
        assert triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"], name
    """


def kernel_cases(dtype: str, g: int, rows: int, head_dim: int, block_size: int) -> list[tuple[str, dict, dict]]:
    """(kernel, signature, constants) of the kernels as the backend launches them: attention
    with one key split and with five (then the merge too; and a sliding window), and the KV write."""
    attention = {"NUM_KV_HEADS": 2, "G": g, "BLOCK_M": rows, "BLOCK_N": triton_attention.BLOCK_N,
                 "HEAD_DIM": head_dim, "BLOCK_SIZE": block_size, "PRECISION": "ieee" if dtype == "fp32" else "tf32"}
    merge = {"NUM_HEADS": 2 * g, "NUM_SPLITS": 5, "SPLITS_P2": 8, "HEAD_DIM": head_dim}
    write_kv = {"NUM_KV_HEADS": 3, "HEADS_P2": 4, "HEAD_DIM": head_dim}
    cases = []
    for name, signature, constants in [("_paged_attention", ATTENTION_SIGNATURE,
                                        {**attention, "NUM_SPLITS": 1, "WINDOW": 0}),
                                       ("_paged_attention", SPLIT_ATTENTION_SIGNATURE,
                                        {**attention, "NUM_SPLITS": 5, "WINDOW": 4096}),
                                       ("_merge_splits", MERGE_SIGNATURE, merge),
                                       ("_write_kv", WRITE_KV_SIGNATURE, write_kv)]:
        signature = {arg: ty.format(dtype=dtype) for arg, ty in signature.items()}
        cases.append((name, {**signature, **dict.fromkeys(constants, "constexpr")}, constants))
    return cases


def test_kernels_compile_for_sm90(tmp_path):
    """What the interpreter does not check (types, layouts, tl.dot shapes): Triton's compiler
    and ptxas build both kernels for an H100/H200, in a process without the interpreter
    (it rewrites triton.language in this one)."""
    cases = [case for config in [("bf16", 7, 16, 64, 16), ("fp16", 3, 64, 128, 1), ("fp32", 1, 16, 16, 4)]
             for case in kernel_cases(*config)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", COMPILE.format(cases=cases)], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, env={**env, "TRITON_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
