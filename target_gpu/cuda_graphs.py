"""CUDA graphs for the target's decode and verify steps (vLLM's "full graph" mode).

A decode or verify step launches hundreds of small kernels (a few per layer); at small
batches the GPU then waits on the host that launches them. A CUDA graph records the whole
forward (every layer, the Triton attention and the LM head) once and replays it with one
launch. Graphs need fixed shapes and fixed addresses, so:

  - a step qualifies when every sequence runs one decoding token plus its draft tree
    (no prefill chunk) and wants its logits: then every row of the step needs logits, in
    order, and the graph computes the LM head over all of them;
  - its T tokens are padded up to the next captured size (GRAPH_SIZES); padded tokens
    have id 0 at position 0, their K/V go to a scratch slot that no sequence owns, and
    the attention programs of the padding point at an empty dummy sequence and do nothing;
  - every input lives in one set of fixed device buffers (StaticStep), refilled before
    each replay from one pinned host buffer (two host-to-device copies per step, no sync);
  - attention tiles are 64 rows high in every graph (KernelMetadata.rows_per_program), so
    one captured kernel serves decodes and trees alike; key splits are chosen as for the
    model's longest sequence (the parts' lengths follow each sequence's own, in the kernel).

Graphs are captured when the runner starts, largest first, in one shared memory pool;
`--enforce-eager` turns them off. Outputs are views into the pool, valid until the next
replay, so the runner copies out what it returns. Without capture (`capture=False`, e.g.
on the CPU under Triton's interpreter) the same padded step runs eagerly: that is how
the padding is tested where there is no GPU.
"""
from __future__ import annotations

import logging

import torch

from target_gpu.attention import AttentionMetadata, KernelFields, KernelMetadata, SeqAttentionInput

log = logging.getLogger(__name__)

GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
ROWS_PER_PROGRAM = 64  # attention tile height (G query heads x query rows) in every graph
MAX_QUERY_LEN = 65  # a decoding token and at most 64 draft nodes per sequence


def padded_size(num_tokens: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size that holds num_tokens, or None when none does."""
    return next((size for size in sizes if size >= num_tokens), None)


class StaticStep:
    """Fixed device buffers holding one padded step: token ids, positions, KV slots and the
    attention kernel's metadata. Row `max_seqs` of the per-sequence buffers stays empty:
    it is the dummy sequence that padded attention programs point at."""

    def __init__(self, max_tokens: int, max_seqs: int, block_size: int, max_model_len: int, rows_per_program: int,
                 device: torch.device):
        self.max_tokens, self.max_seqs, self.block_size = max_tokens, max_seqs, block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.rows_per_program = rows_per_program
        self.tokens = torch.zeros(3, max_tokens, dtype=torch.long, device=device)  # ids, positions, slots
        self.per_seq = torch.zeros(4, max_seqs + 1, dtype=torch.int32, device=device)  # see KernelFields
        self.work = torch.zeros(2, max_tokens, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_seqs + 1, self.max_blocks, dtype=torch.int32, device=device)
        mask_bytes = -(-max_tokens * MAX_QUERY_LEN // 4) * 4  # whole int32 words: it travels with the ints
        self.masks = torch.zeros(mask_bytes, dtype=torch.int8, device=device)
        pin = device.type == "cuda"
        self._host_tokens = torch.zeros(3, max_tokens, dtype=torch.long, pin_memory=pin)
        self._host_ints = torch.zeros(self._num_ints, dtype=torch.int32, pin_memory=pin)

    @property
    def _num_ints(self) -> int:
        return self.per_seq.numel() + self.work.numel() + self.block_tables.numel() + self.masks.numel() // 4

    def inputs(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(ids [N], positions [N], attention metadata) over the first num_tokens rows: the
        views a graph of that size is captured with."""
        ids, positions, slots = self.tokens[:, :num_tokens]
        query_start, query_len, seq_len, mask_offset = self.per_seq
        work_seq, work_row = self.work[:, :num_tokens]
        kernel = KernelMetadata(query_start, query_len, seq_len, self.block_tables, mask_offset, self.masks,
                                work_seq, work_row, self.rows_per_program, self.max_blocks * self.block_size)
        return ids, positions, AttentionMetadata(slots, [], num_tokens, kernel)

    def fits(self, seqs: list[SeqAttentionInput], num_tokens: int) -> bool:
        return (num_tokens <= self.max_tokens and len(seqs) <= self.max_seqs
                and all(s.query_len <= MAX_QUERY_LEN and -(-s.seq_len // self.block_size) <= self.max_blocks
                        for s in seqs))

    def fill(self, input_ids: list[int], positions: list[int], slots: list[int], seqs: list[SeqAttentionInput],
             padded: int, g: int, scratch_slot: int) -> None:
        """Copy one step into the buffers, padded to `padded` tokens (non-blocking on CUDA).

        Only what the step uses travels: the block tables of its B sequences up to its
        longest one, and its tree masks. Whatever an earlier step left beyond them is never
        read: programs read only their own sequence's blocks and mask, and padded programs
        point at the dummy sequence, whose row is never written."""
        n = len(input_ids)
        fields = KernelFields.of(seqs, self.block_size, g, self.rows_per_program)
        host = self._host_tokens
        host.zero_()
        host[0, :n] = torch.tensor(input_ids)
        host[1, :n] = torch.tensor(positions)
        host[2, :n] = torch.tensor(slots)
        host[2, n:padded] = scratch_slot
        b, nb = fields.block_tables.shape
        per_seq = torch.zeros(4, self.max_seqs + 1, dtype=torch.int32)
        per_seq[:, :b] = fields.per_seq
        work = torch.zeros(2, self.max_tokens, dtype=torch.int32)
        work[0, :] = self.max_seqs  # padding: the empty dummy sequence
        work[:, :fields.work.shape[1]] = fields.work
        mask_words = -(-fields.masks.numel() // 4)
        masks = torch.zeros(4 * mask_words, dtype=torch.int8)
        masks[:fields.masks.numel()] = fields.masks
        parts = [per_seq.flatten(), work.flatten(), fields.block_tables.flatten(), masks.view(torch.int32)]
        used = sum(part.numel() for part in parts)
        torch.cat(parts, out=self._host_ints[:used])
        self.tokens.copy_(host, non_blocking=True)
        device_ints = self._host_ints[:used].to(self.tokens.device, non_blocking=True)
        per_seq_d, work_d, tables_d, masks_d = device_ints.split([part.numel() for part in parts])
        self.per_seq.copy_(per_seq_d.view_as(self.per_seq))
        self.work.copy_(work_d.view_as(self.work))
        self.block_tables[:b, :nb].copy_(tables_d.view(b, nb))
        self.masks[:4 * mask_words].copy_(masks_d.view(torch.int8))


class CudaGraphRunner:
    """Captured forwards (hidden states and logits of every row) per padded token count."""

    def __init__(self, model, attention, kv_cache, max_tokens: int, max_seqs: int, max_model_len: int,
                 scratch_slot: int, capture: bool = True, feature_layers: tuple[int, ...] = ()):
        self.model = model
        self.feature_layers = feature_layers
        self.attention = attention
        self.block_size = kv_cache.block_size
        self.scratch_slot = scratch_slot
        self.sizes = tuple(s for s in GRAPH_SIZES if s <= max_tokens) or (GRAPH_SIZES[0],)
        device = kv_cache.k[0].device
        cfg = model.config
        self.g = cfg.num_heads // cfg.num_kv_heads
        rows = max(ROWS_PER_PROGRAM, 1 << (self.g - 1).bit_length())
        self.static = StaticStep(self.sizes[-1], max_seqs, self.block_size, max_model_len, rows, device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor, torch.Tensor]] = {}
        self.capture = capture
        if capture:
            self._capture_all()

    def _forward(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, positions, meta = self.static.inputs(num_tokens)
        backend = self.attention

        def attention(layer_idx, q, k, v):
            return backend.forward(layer_idx, q, k, v, meta)

        hidden = self.model(ids, positions, attention, self.feature_layers)  # [N, H'] (ModelRunner.execute)
        return hidden, self.model.compute_logits(hidden[:, :self.model.config.hidden_size])  # [N, V]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory
                self.static.tokens[2, :size] = self.scratch_slot  # a warm-up writes K/V only to the scratch slot
                self._forward(size)  # compiles the kernels, settles the allocator
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    hidden, logits = self._forward(size)
                self.graphs[size] = (graph, hidden, logits)
        torch.cuda.current_stream().wait_stream(stream)
        log.info("CUDA graphs: captured %d sizes (%s tokens)", len(self.sizes), ", ".join(map(str, self.sizes)))

    def can_run(self, seqs: list[SeqAttentionInput], num_tokens: int) -> bool:
        return padded_size(num_tokens, self.sizes) is not None and self.static.fits(seqs, num_tokens)

    def run(self, input_ids: list[int], positions: list[int], slots: list[int],
            seqs: list[SeqAttentionInput]) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states [T, H'], logits [T, V]) of one step's T rows; copies, not views."""
        n = len(input_ids)
        size = padded_size(n, self.sizes)
        self.static.fill(input_ids, positions, slots, seqs, size, self.g, self.scratch_slot)
        if self.capture:
            graph, hidden, logits = self.graphs[size]
            graph.replay()
        else:
            hidden, logits = self._forward(size)
        return hidden[:n].clone(), logits[:n].clone()
