"""A plain decode step (every sequence brings one new token, no draft tree) as one
torch.compile'd graph: the whole decoder, its paged attention and the LM head.

Eager PyTorch spends most of a small model's decode step dispatching small operators
(norms, rotary, residual adds, attention glue: about 70 per layer). Inductor fuses them into
a few C++ kernels per layer around the weight kernels (quant_linear's int4/int8 calls,
oneDNN's), so what is left is close to the time the weights take to stream from memory.
Every other step (prefill chunks, tree verification) runs eagerly, as before.

The attention here is decode-only: each sequence's one query attends to its first seq_len
cached keys, gathered by its block table (the new key is written to its slot first), so
the step is described by five tensors whose sizes are the only things that vary:
  input_ids, positions, slots, seq_lens [B]; block_tables [B, NB].
B and NB are compiled dynamic (dynamic=True): one graph for one sequence and one for
more (Dynamo specialises sizes 0 and 1; NB is padded to at least 2 for that reason), both
compiled when the runner is built (warm_up), so no request waits on compilation.
"""
from __future__ import annotations

import functools
import time

import torch

from runtime.models.packed_linear import PackedLinear
from target_gpu.kv_cache import KVCache


def paged_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """q [B, Hq, D], k, v [B, Hkv, D] (one new token each) -> [B, Hq, D].
    k_cache, v_cache [num_blocks, block_size, Hkv, D]; slots, seq_lens [B]; block_tables [B, NB];
    window: a sliding window (the query sees its last `window` keys, itself included)."""
    b, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    g = num_heads // num_kv_heads
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size  # [B]
    k_cache[blocks, offsets] = k  # an index_put_ on the cache itself, which Inductor does in place
    v_cache[blocks, offsets] = v
    keys = k_cache[block_tables].flatten(1, 2)[:, :, :, None, :].float()  # [B, L, Hkv, 1, D], L = NB * block_size
    values = v_cache[block_tables].flatten(1, 2)[:, :, :, None, :].float()
    length = keys.shape[1]
    key_index = torch.arange(length, device=q.device)[None, :]
    mask = key_index < seq_lens[:, None]  # [B, L]
    if window is not None:
        mask &= key_index >= seq_lens[:, None] - window
    queries = q.view(b, 1, num_kv_heads, g, head_dim).float()  # the G query heads of a KV head share its keys
    # products and sums rather than matmuls (or F.scaled_dot_product_attention): Inductor reads
    # the gathered keys and values in place, in the cache's layout, with no transposed copy (and
    # SDPA's CPU lowering specialised the graph on L: a recompile each time a sequence grew a block)
    scores = (queries * keys).sum(-1) * head_dim ** -0.5  # [B, L, Hkv, G]
    scores = scores.masked_fill(~mask[:, :, None, None], float("-inf"))
    out = (scores.softmax(1)[..., None] * values).sum(1)  # [B, Hkv, G, D]
    return out.to(q.dtype).reshape(b, num_heads, head_dim)


def decode_step(model, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], feature_layers: tuple[int, ...],
                input_ids, positions, slots, block_tables, seq_lens) -> tuple[torch.Tensor, torch.Tensor]:
    """One plain decode step of `model` over per-layer KV caches; (logits [B, V], hidden [B, H'])."""

    def attention(layer_idx, q, k, v):
        return paged_decode_attention(q, k, v, k_caches[layer_idx], v_caches[layer_idx], slots, block_tables,
                                      seq_lens, model.config.sliding_window)

    hidden = model(input_ids, positions, attention, feature_layers)  # [B, H']
    return model.compute_logits(hidden[:, :model.config.hidden_size]), hidden


@functools.cache
def compiled_decode_step(cpp_wrapper: bool):
    """decode_step compiled, one function for every engine in the process: the model and its
    caches are arguments, so a second engine on the same architecture reuses the first one's
    graphs. cpp_wrapper: the graph's kernels are called from generated C++, not Python (a
    fifth of a small model's step was Python calling kernels); a model with oneDNN-prepacked
    weights (PackedLinear: opaque tensors, which the C++ wrapper cannot pass to an op) keeps
    the Python wrapper.
    Made on first use: torch.compile imports Dynamo (and Triton, where installed)."""
    return torch.compile(decode_step, dynamic=True, fullgraph=True, options={"cpp_wrapper": cpp_wrapper})


class CompiledDecodeStep:
    """Runs a decode step's tokens through `model` compiled; returns logits [B, V] (float32)
    and the final hidden states [B, H'] (H' as DecoderModel.forward gives them)."""

    def __init__(self, model, kv_cache: KVCache, feature_layers: tuple[int, ...] = ()):
        self.model, self.kv_cache, self.feature_layers = model, kv_cache, feature_layers
        opaque = any(isinstance(m, PackedLinear) for m in model.modules())
        self.step = compiled_decode_step(cpp_wrapper=not opaque)
        for cache in (*kv_cache.k, *kv_cache.v):  # [num_blocks, block_size, Hkv, D]
            # all but num_blocks fixed: left dynamic, a dim equal to B or NB shares their symbol
            # (duck sizing) and pins it (Qwen2.5-0.5B's 2 KV heads recompiled at NB = 3)
            for dim in (1, 2, 3):
                torch._dynamo.mark_static(cache, dim)

    @torch.inference_mode()  # as ModelRunner.execute runs: the graphs guard on it
    def warm_up(self, scratch_block: int, device: torch.device) -> float:
        """Compile the graphs of one sequence and of several now, running dummy tokens whose
        KV goes to the scratch block; the seconds it took."""
        start = time.perf_counter()
        block_size = self.kv_cache.k[0].shape[1]
        for b in (1, 2):
            ids = torch.zeros(b, dtype=torch.long, device=device)
            slots = torch.full((b,), scratch_block * block_size, dtype=torch.long, device=device)
            tables = torch.full((b, 2), scratch_block, dtype=torch.long, device=device)  # [B, NB]
            self.step(self.model, self.kv_cache.k, self.kv_cache.v, self.feature_layers, ids, ids.clone(), slots,
                      tables, torch.ones(b, dtype=torch.long, device=device))
        return time.perf_counter() - start

    def __call__(self, seqs, device: torch.device, block_size: int):
        """Run the next token of each of `seqs` (Sequence-like: token_ids, num_computed_tokens,
        block_table); returns (logits [B, V], hidden [B, H'])."""
        starts = [seq.num_computed_tokens for seq in seqs]
        num_blocks = max(2, max(start // block_size + 1 for start in starts))
        tables = [seq.block_table[:num_blocks] for seq in seqs]
        ints = torch.tensor([[seq.token_ids[start] for seq, start in zip(seqs, starts)], starts,
                             [t[start // block_size] * block_size + start % block_size
                              for t, start in zip(tables, starts)],
                             [start + 1 for start in starts]], dtype=torch.long)  # [4, B]
        block_tables = torch.tensor([t + [0] * (num_blocks - len(t)) for t in tables], dtype=torch.long)  # [B, NB]
        ids, positions, slots, seq_lens = (row.to(device) for row in ints.unbind(0))  # own storage each
        return self.step(self.model, self.kv_cache.k, self.kv_cache.v, self.feature_layers, ids.clone(),
                         positions.clone(), slots.clone(), block_tables.to(device), seq_lens.clone())
