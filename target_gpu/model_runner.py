"""Runs the target model for one scheduled step over the paged KV cache.

Input: the step's sequences, how many new tokens each brings, and which ones need logits
(those whose new tokens reach the end of what they have; a prefill chunk in the middle of
a prompt needs none). Output: logits [N, V] (float32) for those, in order. The runner
neither schedules nor samples.
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
    def execute(self, seqs, num_new_tokens: list[int], needs_logits: list[bool],
                masks: list[torch.Tensor | None] | None = None) -> torch.Tensor:
        """Run the new tokens of `seqs`; return logits [N, V] for the rows where needs_logits."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        attn_inputs: list[SeqAttentionInput] = []
        logits_rows: list[int] = []
        bs = self.block_size
        for i, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
            start = seq.num_computed_tokens
            table = seq.block_table
            input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            attn_inputs.append(SeqAttentionInput(len(input_ids) - n, n, start + n, table,
                                                 None if masks is None else masks[i]))
            if needs_logits[i]:
                logits_rows.append(len(input_ids) - 1)
        device = self.device
        ids = torch.tensor(input_ids, dtype=torch.long, device=device)
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        meta = AttentionMetadata.build(attn_inputs, torch.tensor(slots, dtype=torch.long, device=device), bs,
                                       self.config.num_heads // self.config.num_kv_heads, device)
        backend = self.attention

        def attention(layer_idx, q, k, v):
            return backend.forward(layer_idx, q, k, v, meta)

        hidden = self.model(ids, pos, attention)  # [T, hidden]
        if not logits_rows:
            return torch.empty(0, self.config.vocab_size, device=device)
        rows = torch.tensor(logits_rows, dtype=torch.long, device=device)
        return self.model.compute_logits(hidden.index_select(0, rows))  # [N, V]
