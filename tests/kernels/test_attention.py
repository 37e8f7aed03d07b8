"""TorchAttentionBackend (paged, ragged, GQA, tree masks) against naive attention written
here: per sequence, K/V gathered by position, K/V heads repeated, explicit softmax in float64."""
from __future__ import annotations

import math
import random

import pytest
import torch

from runtime.models.config import ModelConfig
from target_gpu.attention import MAX_BATCHED_QUERY_LEN, AttentionMetadata, SeqAttentionInput, TorchAttentionBackend
from target_gpu.kv_cache import KVCache

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
HEADS = [(4, 4), (4, 2), (6, 2)]  # (query heads, kv heads): GQA ratios 1, 2, 3


def causal_mask(context_len: int, query_len: int) -> torch.Tensor:
    """New token j sits at position context_len + j and sees every position up to its own."""
    seq_len = context_len + query_len
    return torch.arange(seq_len).unsqueeze(0) <= (context_len + torch.arange(query_len)).unsqueeze(1)


def tree_mask(context_len: int, query_len: int, rng: random.Random) -> torch.Tensor:
    """A random token tree: every new token sees the context, its ancestors and itself."""
    mask = torch.zeros(query_len, context_len + query_len, dtype=torch.bool)
    mask[:, :context_len] = True
    parents = [rng.randint(-1, j - 1) for j in range(query_len)]
    for j in range(query_len):
        node = j
        while node != -1:
            mask[j, context_len + node] = True
            node = parents[node]
    return mask


def naive_attention(q, k, v, mask):
    """q [Q, Hq, D]; k, v [L, Hkv, D]; mask [Q, L] bool -> [Q, Hq, D] (float64)."""
    g = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(g, dim=1)  # query head h reads kv head h // g
    v = v.double().repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,lhd->hql", q.double(), k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hql,lhd->qhd", scores.softmax(dim=-1), v)


def run_case(query_lens, context_lens, num_heads, num_kv_heads, dtype, *, masks=None, block_size=4,
             head_dim=16, layer=1, seed=0, device="cpu", context_columns=None):
    """Run one step of the backend over a random paged layout and compare with naive attention
    (computed on the CPU in float64). context_columns: the backend gets tree masks over the
    last context_columns cached keys and the new tokens only (the contract: earlier keys
    are everyone's); the reference keeps the whole [Q, L] mask."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    cfg = ModelConfig(architecture="llama", vocab_size=8, hidden_size=num_heads * head_dim, intermediate_size=8,
                      num_layers=2, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    cache = KVCache(cfg, num_blocks, block_size, dtype, device)
    for tensors in (cache.k, cache.v):  # the whole pool holds garbage, so a wrong gather shows
        for t in tensors:
            t.copy_(torch.randn(t.shape, generator=gen))
    before_k = [t.cpu().clone() for t in cache.k]  # the pool before the step
    before_v = [t.cpu().clone() for t in cache.v]
    free = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, out-of-order blocks
    tables = []
    for n in seq_lens:
        nb = -(-n // block_size)
        tables.append(free[:nb])
        free = free[nb:]

    def slot(i, p):
        return tables[i][p // block_size] * block_size + p % block_size

    total = sum(query_lens)
    q = torch.randn(total, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
    k_flat = before_k[layer].view(-1, num_kv_heads, head_dim)
    v_flat = before_v[layer].view(-1, num_kv_heads, head_dim)
    inputs, slots, start = [], [], 0
    context_k, context_v = [], []
    for i, (c, n) in enumerate(zip(context_lens, query_lens)):
        ctx_slots = torch.tensor([slot(i, p) for p in range(c)], dtype=torch.long)
        context_k.append(k_flat[ctx_slots])  # what earlier steps left in the cache
        context_v.append(v_flat[ctx_slots])
        slots.extend(slot(i, p) for p in range(c, c + n))
        mask = None if masks is None else masks[i]
        if mask is not None and context_columns is not None:
            mask = mask[:, max(c - context_columns, 0):]  # [Q, M]
        inputs.append(SeqAttentionInput(start, n, c + n, tables[i], mask))
        start += n
    slot_mapping = torch.tensor(slots, dtype=torch.long)
    meta = AttentionMetadata.build(inputs, slot_mapping.to(device), block_size, num_heads // num_kv_heads, device)
    out = TorchAttentionBackend(cache).forward(layer, q.to(device), k.to(device), v.to(device), meta)

    assert out.shape == q.shape and out.dtype == dtype and out.device.type == device.type
    out = out.cpu()
    k_flat = cache.k[layer].cpu().view(-1, num_kv_heads, head_dim)
    v_flat = cache.v[layer].cpu().view(-1, num_kv_heads, head_dim)
    assert torch.equal(k_flat[slot_mapping], k) and torch.equal(v_flat[slot_mapping], v), "new K/V not in the cache"
    assert torch.equal(cache.k[1 - layer].cpu(), before_k[1 - layer]), "another layer's cache was written"
    written = torch.zeros(k_flat.shape[0], dtype=torch.bool)
    written[slot_mapping] = True
    assert torch.equal(k_flat[~written], before_k[layer].view_as(k_flat)[~written]), "a slot outside the step changed"
    start = 0
    for i, (c, n) in enumerate(zip(context_lens, query_lens)):
        rows = slice(start, start + n)
        mask = causal_mask(c, n) if masks is None or masks[i] is None else masks[i]
        expected = naive_attention(q[rows], torch.cat([context_k[i], k[rows]]), torch.cat([context_v[i], v[rows]]), mask)
        torch.testing.assert_close(out[rows].double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype],
                                   msg=lambda m: f"sequence {i} (context {c}, query {n}): {m}")
        start += n


DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_decode_batch(heads, dtype):
    run_case([1] * 6, [0, 1, 3, 4, 17, 40], *heads, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_single_prefill(heads, dtype):
    run_case([37], [0], *heads, dtype)
    run_case([MAX_BATCHED_QUERY_LEN + 1], [10], *heads, dtype, block_size=16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_ragged_batch(heads, dtype, device):
    """Decodes, short and long prefill chunks (query_len both sides of MAX_BATCHED_QUERY_LEN) in one step."""
    query_lens = [1, 3, 1, MAX_BATCHED_QUERY_LEN, MAX_BATCHED_QUERY_LEN + 1, 40, 1, 2]
    context_lens = [5, 0, 33, 2, 0, 9, 0, 7]
    run_case(query_lens, context_lens, *heads, dtype, seed=1, device=device)


@pytest.mark.parametrize("seed", range(6))
def test_random_ragged_batches(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 8)
    query_lens = [rng.choice([1, 1, 2, 5, MAX_BATCHED_QUERY_LEN, 23, 50]) for _ in range(n)]
    context_lens = [rng.randint(0, 40) for _ in range(n)]
    run_case(query_lens, context_lens, *rng.choice(HEADS), rng.choice([torch.float32, torch.bfloat16]),
             block_size=rng.choice([1, 4, 16]), seed=seed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_tree_masks(heads, dtype, device):
    """Random token trees (each node sees the context and its ancestors) batched with causal sequences."""
    rng = random.Random(7)
    query_lens = [1, 5, 8, 4, MAX_BATCHED_QUERY_LEN + 4, 3]
    context_lens = [12, 20, 0, 3, 6, 9]
    masks = [None, tree_mask(20, 5, rng), tree_mask(0, 8, rng), None, tree_mask(6, 20, rng), tree_mask(9, 3, rng)]
    run_case(query_lens, context_lens, *heads, dtype, masks=masks, seed=2, device=device)


@pytest.mark.parametrize("context_columns", [0, 2])
def test_tree_masks_over_the_last_keys(context_columns):
    """Masks that cover only the new tokens (the target's trees) or a few cached keys more
    (an EAGLE head's earlier drafts): the keys before them are seen by every new token."""
    rng = random.Random(8)
    query_lens, context_lens = [5, 8, 1, MAX_BATCHED_QUERY_LEN + 2], [20, 0, 7, 6]
    masks = [tree_mask(20, 5, rng), tree_mask(0, 8, rng), None, tree_mask(6, MAX_BATCHED_QUERY_LEN + 2, rng)]
    run_case(query_lens, context_lens, 4, 2, torch.float32, masks=masks, seed=3, context_columns=context_columns)


def test_chain_mask_equals_causal():
    """A tree with a single branch is the causal mask."""
    chain = torch.zeros(6, 16, dtype=torch.bool)
    chain[:, :10] = True
    for j in range(6):
        chain[j, 10:10 + j + 1] = True
    assert torch.equal(chain, causal_mask(10, 6))
    run_case([6], [10], 4, 2, torch.float32, masks=[chain])


@pytest.mark.parametrize("query_lens", [[MAX_BATCHED_QUERY_LEN + 4, 1], [1, 1, MAX_BATCHED_QUERY_LEN + 4],
                                        [3, 3, MAX_BATCHED_QUERY_LEN + 1, 40]],
                         ids=["long-then-decode", "decodes-then-long", "equal-chunks-then-long"])
def test_first_group_is_a_prefix_of_the_batch(query_lens):
    """Running decodes followed by a new prompt's prefill chunk: the engine's most common mixed step.

    Regression: at bf8529a a group whose rows were an unpadded prefix of a longer batch skipped
    its gather (query_index=None) and _attend_group reshaped the whole q: RuntimeError."""
    run_case(query_lens, [0, 5, 2, 9][:len(query_lens)], 4, 2, torch.float32)
