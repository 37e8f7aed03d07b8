"""Context-parallel prefill with ring attention (Liu et al., "Ring Attention with Blockwise
Transformers", 2023): a long prompt is split across N ranks, each runs the whole model on its
slice of the tokens, and inside every layer the slices' K/V travel around the ring.

- **Slices.** Zig-zag (`zigzag_positions`): the prompt is cut into 2N chunks as even as
  possible and rank r takes chunks r and 2N-1-r, so under the causal mask every rank has
  about the same work (contiguous slices would leave the first rank almost idle). Positions
  travel with the tokens: rotary embeddings and the causal mask read them, so a slice need
  not be contiguous.
- **The ring.** At each layer a rank attends its queries to its own K/V block, and meanwhile
  sends that block to rank r+1 and receives rank r-1's; N-1 such steps show every rank every
  block, each transfer overlapped with one block's attention. Blocks are padded to the
  longest slice (padding sits at a position no query sees), so every message has one shape.
- **The merge.** Each block gives a partial output and the log-sum-exp of its scores per
  query and head; partials combine exactly (the online softmax of FlashAttention):
  lse = logaddexp(lse1, lse2), out = out1 e^(lse1 - lse) + out2 e^(lse2 - lse). A query
  that sees nothing of a block (lse = -inf) takes nothing from it.
- **Earlier context.** A chunk after the first attends to the prompt before it too: its K/V
  (read from the paged cache by the rank that decodes, and broadcast once per chunk; with a
  sliding window only the part the chunk's first query still sees) is one more block every
  rank attends to, merged like the others.
- **Sliding windows** (Mistral, Qwen2) mask keys at or beyond `window` positions back, as
  the paged backends do.
- **Failures.** A rank that dies or stops answering mid-ring makes the others' transfers
  fail (gloo: the peer's connection closes, or the group's timeout passes); the error is
  raised as ContextParallelError naming the layer, the ring step and the peers, never a hang.

Each block's attention runs in the model's dtype (PyTorch's fused CPU kernel); the merge in
float32. `RingAttention` is the decoder's AttentionFn for one rank; it keeps the rank's own
K/V per layer, which the caller writes into the paged cache of the rank that decodes.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

PAD_POSITION = 1 << 40  # the position of a block's padding: after every query, so never seen


class ContextParallelError(RuntimeError):
    """A rank of the ring failed or stopped answering mid-prefill."""


def zigzag_slices(length: int, world: int) -> list[torch.Tensor]:
    """The prompt positions each rank of `world` takes, [T_rank] (long, increasing) by rank:
    rank r takes chunks r and 2*world-1-r of 2*world chunks as even as possible."""
    bounds = [round(i * length / (2 * world)) for i in range(2 * world + 1)]
    return [torch.cat([torch.arange(bounds[r], bounds[r + 1]), torch.arange(bounds[-r - 2], bounds[-r - 1])])
            for r in range(world)]


def window_start(start: int, window: int | None) -> int:
    """The first position a query at `start` (or after it) still sees under a sliding window."""
    return max(0, start - window + 1) if window is not None else 0


def block_attention(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor,
                    window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of queries q [T, Hq, D] at q_pos [T] to one block of keys k, v
    [S, Hkv, D] at k_pos [S] -> (out [T, Hq, D] float32, lse [Hq, T] float32); a query that
    sees no key of the block gets out 0 and lse -inf. PyTorch's fused CPU attention (the
    kernel behind scaled_dot_product_attention, which also returns the log-sum-exp) under a
    mask from the positions: zig-zag slices are not contiguous, so is_causal cannot say it."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [S, Hq, D]
    visible = k_pos[None, :] <= q_pos[:, None]  # [T, S]
    if window is not None:
        visible &= q_pos[:, None] - k_pos[None, :] < window
    mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill_(~visible, float("-inf"))
    heads_first = [t.transpose(0, 1).contiguous()[None] for t in (q, k, v)]  # [1, H, T|S, D]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*heads_first, 0.0, False,
                                                                          attn_mask=mask[None, None])
    lse = lse[0].masked_fill(~visible.any(dim=1)[None, :], float("-inf"))  # the kernel gives such rows 0
    return out[0].transpose(0, 1).float(), lse  # [T, Hq, D], [Hq, T]


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions over disjoint keys (out [T, H, D], lse [H, T]) -> their union's."""
    total = torch.logaddexp(lse, block_lse)  # [H, T]
    old = torch.exp(lse - total).nan_to_num(0.0).t()[..., None]  # [T, H, 1]
    new = torch.exp(block_lse - total).nan_to_num(0.0).t()[..., None]
    return out * old + block_out * new, total


class RingAttention:
    """The decoder's AttentionFn for rank `rank` of a ring of `world` (ranks[i]: the global
    rank of ring member i in `group`): queries, keys and values are this rank's slice, at
    `positions` [T]; every slice is padded to `block_len` tokens in transit."""

    def __init__(self, positions: torch.Tensor, block_len: int, rank: int, world: int, ranks: list[int],
                 group=None, window: int | None = None, prefix: torch.Tensor | None = None, start: int = 0):
        """prefix: the K/V of the context before the chunk that it still sees, every rank's
        alike [layers, 2, P, Hkv, D] (positions start-P..start-1; start: the chunk's first), or None."""
        self.positions, self.block_len, self.window, self.prefix = positions, block_len, window, prefix
        self.prefix_positions = torch.arange(start - prefix.shape[2], start) if prefix is not None else None
        self.rank, self.world, self.ranks, self.group = rank, world, ranks, group
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> this slice's (k, v) [T, Hkv, D]
        self.comm_s = 0.0  # seconds waiting for transfers (what compute did not hide)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.kv[layer] = (k, v)
        t = k.shape[0]
        block = k.new_zeros(2, self.block_len, *k.shape[1:])  # [2, L, Hkv, D]: K and V, padded
        block[0, :t], block[1, :t] = k, v
        block_pos = torch.full((self.block_len,), PAD_POSITION, dtype=torch.long)
        block_pos[:t] = self.positions
        out = lse = None
        if self.prefix is not None and self.prefix.shape[2]:
            prefix_k, prefix_v = self.prefix[layer]  # [P, Hkv, D] each
            out, lse = block_attention(q, self.positions, prefix_k, prefix_v, self.prefix_positions, self.window)
        for step in range(self.world):
            pending = self._pass_on(block, block_pos, layer, step) if step < self.world - 1 else None
            part = block_attention(q, self.positions, block[0], block[1], block_pos, self.window)
            out, lse = part if out is None else merge(out, lse, *part)
            if pending is not None:
                block, block_pos = self._received(pending, layer, step)
        return out.to(q.dtype)  # [T, Hq, D]

    def _peers(self) -> tuple[int, int]:
        return self.ranks[(self.rank + 1) % self.world], self.ranks[(self.rank - 1) % self.world]

    def _pass_on(self, block: torch.Tensor, block_pos: torch.Tensor, layer: int, step: int):
        """Start sending this block to the next rank and receiving the previous rank's."""
        to, frm = self._peers()
        incoming, incoming_pos = torch.empty_like(block), torch.empty_like(block_pos)
        try:
            requests = [dist.isend(block, to, group=self.group), dist.isend(block_pos, to, group=self.group),
                        dist.irecv(incoming, frm, group=self.group), dist.irecv(incoming_pos, frm, group=self.group)]
        except (RuntimeError, dist.DistError) as e:
            raise self._failure(layer, step, e) from e
        return requests, incoming, incoming_pos

    def _received(self, pending, layer: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        requests, incoming, incoming_pos = pending
        start = time.perf_counter()
        try:
            for request in requests:
                request.wait()
        except (RuntimeError, dist.DistError) as e:
            raise self._failure(layer, step, e) from e
        self.comm_s += time.perf_counter() - start
        return incoming, incoming_pos

    def _failure(self, layer: int, step: int, e: BaseException) -> ContextParallelError:
        to, frm = self._peers()
        return ContextParallelError(f"ring attention failed at layer {layer}, ring step {step + 1} of "
                                    f"{self.world - 1}: rank {self.ranks[self.rank]} could not exchange K/V with "
                                    f"rank {to} (next) / {frm} (previous): {str(e).splitlines()[0] if str(e) else e!r}")


def ring_prefill(model, token_ids: torch.Tensor, rank: int, world: int, ranks: list[int] | None = None,
                 group=None, start: int = 0,
                 prefix: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor], RingAttention]:
    """This rank's part of a context-parallel prefill of the chunk token_ids [L] (every rank
    has it) at positions start..start+L-1, after the context whose K/V is `prefix`
    [layers, 2, P, Hkv, D] (every rank's alike: positions start-P..start-1, what the chunk
    sees of it; None when start is 0): (final hidden states of its positions [T, H], every
    rank's positions within the chunk (zigzag_slices), the RingAttention holding its K/V per
    layer). Rank 0 holds the chunk's last position (the last of the 2N chunks)."""
    slices = zigzag_slices(token_ids.shape[0], world)
    block_len = max(len(s) for s in slices)
    window = getattr(model.config, "sliding_window", None)
    positions = slices[rank] + start
    attention = RingAttention(positions, block_len, rank, world, ranks or list(range(world)), group, window, prefix,
                              start)
    hidden = model(token_ids[slices[rank]], positions, attention)  # [T, H]
    return hidden, slices, attention
