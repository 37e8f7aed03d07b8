"""Runs the target model for one scheduled step over the paged KV cache.

Input: the step's sequences, how many of their own new tokens each brings, which ones
need logits (those whose new tokens reach the end of what they have; a prefill chunk in
the middle of a prompt needs none), and a draft tree per sequence (empty when plain).

A decoding sequence with a tree of n nodes runs 1 + n tokens: its last committed token
(the root) at position L-1, node i at position L-1 + depth(i), each attending to the
whole committed context and to its tree ancestors only (the tree mask). Their KV goes to
the sequence's next 1 + n slots in node order, and logits come back for all 1 + n rows.
After acceptance, `commit_accepted` moves the accepted path's KV to consecutive slots;
what is beyond is simply not counted as computed any more (the block manager releases
the blocks). Output: logits [R, V] (float32) for the rows asked for, in order. The
runner neither schedules nor samples.
"""
from __future__ import annotations

import torch

from runtime.models.config import ModelConfig
from runtime.models.decoder import DecoderModel
from target_gpu.attention import AttentionMetadata, SeqAttentionInput, TorchAttentionBackend
from target_gpu.kv_cache import KVCache


class ModelRunner:
    def __init__(self, model: DecoderModel, config: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device):
        self.model = model
        self.config = config
        self.device = device
        self.block_size = block_size
        self.kv_cache = KVCache(config, num_blocks, block_size, model.dtype, device)
        self.attention = TorchAttentionBackend(self.kv_cache)

    @torch.inference_mode()
    def execute(self, seqs, num_new_tokens: list[int], needs_logits: list[bool], trees=None,
                return_hidden: bool | str = False):
        """Run the new tokens (and draft nodes) of `seqs`; return logits [R, V] for the rows
        asked for: the last new token when plain, the root and every node with a tree.
        With return_hidden: (logits [R, V], final hidden states [R, H]) of those rows; with
        return_hidden="all": (logits [R, V], final hidden states [T, H] of every token run,
        in input order: each sequence's new tokens, then its tree nodes)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        attn_inputs: list[SeqAttentionInput] = []
        logits_rows: list[int] = []
        bs = self.block_size
        for i, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
            start = seq.num_computed_tokens
            table = seq.block_table
            tree = trees[i] if trees is not None else None
            num_nodes = len(tree) if tree is not None else 0
            first_row = len(input_ids)
            input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            mask = None
            if num_nodes:
                assert n == 1 and needs_logits[i], "a draft tree hangs below one decoding token"
                input_ids.extend(tree.token_ids)
                positions.extend(start + depth for depth in tree.depths)
                mask = torch.ones(1 + num_nodes, start + 1 + num_nodes, dtype=torch.bool)  # [Q, L]
                mask[:, start:] = tree.attention_mask()
            total = n + num_nodes
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + total))
            attn_inputs.append(SeqAttentionInput(first_row, total, start + total, table, mask))
            if needs_logits[i]:
                logits_rows.extend(range(first_row + n - 1, first_row + total))
        device = self.device
        ids = torch.tensor(input_ids, dtype=torch.long, device=device)
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        meta = AttentionMetadata.build(attn_inputs, torch.tensor(slots, dtype=torch.long, device=device), bs,
                                       self.config.num_heads // self.config.num_kv_heads, device)
        backend = self.attention

        def attention(layer_idx, q, k, v):
            return backend.forward(layer_idx, q, k, v, meta)

        all_hidden = self.model(ids, pos, attention)  # [T, H]
        rows = torch.tensor(logits_rows, dtype=torch.long, device=device)
        hidden = all_hidden.index_select(0, rows)  # [R, H]
        logits = self.model.compute_logits(hidden)  # [R, V]
        if return_hidden == "all":
            return logits, all_hidden
        return (logits, hidden) if return_hidden else logits

    @torch.inference_mode()
    def commit_accepted(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Move accepted draft tokens' KV to where their positions say (no-op when empty)."""
        if src_slots:
            self.kv_cache.copy_slots(torch.tensor(src_slots, device=self.device),
                                     torch.tensor(dst_slots, device=self.device))
