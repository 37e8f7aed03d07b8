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
more (Dynamo specialises sizes 0 and 1; NB is padded to at least 2 for that reason), so
steps stop waiting on compilation after the first of each kind.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from target_gpu.kv_cache import KVCache


def paged_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, D], k, v [B, Hkv, D] (one new token each) -> [B, Hq, D].
    k_cache, v_cache [num_blocks, block_size, Hkv, D]; slots, seq_lens [B]; block_tables [B, NB]."""
    b, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    g = num_heads // num_kv_heads
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size  # [B]
    k_cache[blocks, offsets] = k  # an index_put_ on the cache itself, which Inductor does in place
    v_cache[blocks, offsets] = v
    keys = k_cache[block_tables].flatten(1, 2).transpose(1, 2)  # [B, Hkv, L, D], L = NB * block_size
    values = v_cache[block_tables].flatten(1, 2).transpose(1, 2)
    length = keys.shape[2]
    mask = torch.arange(length, device=q.device)[None, :] < seq_lens[:, None]  # [B, L]
    queries = q.view(b, num_kv_heads, g, head_dim)  # the G query heads of a KV head share its keys
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask[:, None, None, :])  # [B, Hkv, G, D]
    return out.reshape(b, num_heads, head_dim)


class CompiledDecodeStep:
    """Runs a decode step's tokens through `model` compiled; returns logits [B, V] (float32)
    and the final hidden states [B, H'] (H' as DecoderModel.forward gives them)."""

    def __init__(self, model, kv_cache: KVCache, feature_layers: tuple[int, ...] = ()):
        self.model, self.kv_cache, self.feature_layers = model, kv_cache, feature_layers
        self._compiled = torch.compile(self._forward, dynamic=True, fullgraph=True)

    def _forward(self, input_ids, positions, slots, block_tables, seq_lens):
        cache = self.kv_cache

        def attention(layer_idx, q, k, v):
            return paged_decode_attention(q, k, v, cache.k[layer_idx], cache.v[layer_idx], slots, block_tables,
                                          seq_lens)

        hidden = self.model(input_ids, positions, attention, self.feature_layers)  # [B, H']
        return self.model.compute_logits(hidden[:, :self.model.config.hidden_size]), hidden

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
        return self._compiled(ids.clone(), positions.clone(), slots.clone(), block_tables.to(device), seq_lens.clone())
