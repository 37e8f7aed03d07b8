"""Tensor parallelism for DecoderModel: Megatron-LM's split (Shoeybi et al. 2019), the same
for every family the decoder covers.

Each of N ranks keeps:
  - q/k/v and gate/up column-parallel: its heads' rows of qkv_proj (its q heads, its KV
    heads) and its slice of the intermediate rows of gate_up_proj;
  - o and down row-parallel: the matching input columns, then one all-reduce each, so
    every rank holds the full residual stream after each block;
  - KV heads split across ranks; with fewer KV heads than ranks (GQA), each KV head is
    replicated on the ranks whose q heads read it;
  - the embedding and the LM head vocab-parallel: a contiguous range of token ids each;
    an id outside the range embeds to zeros and the all-reduce sums the one rank that has
    it; the logits' shards are gathered.
Norms, rotary tables and everything outside the linear layers stay replicated.

Float layers are sliced into new nn.Linear layers; quantized ones (runtime.models.quant_linear)
keep their rows or input columns in place, in their kernel's layout: whole blocks of 16
outputs, whole groups (and k blocks of 32) of inputs; a split that cuts one is refused. The
vocabulary is split in units of 16 token ids for the same reason.

`shard_model(model, tp)` does this in place on a loaded model; `sharded_config`
says what one rank holds (for sizing its KV cache). A model whose head counts do not
divide among the ranks is refused before anything changes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from runtime.models.config import ModelConfig
from runtime.models.quant_linear import QuantizedLinear


@dataclass(frozen=True, slots=True)
class TPGroup:
    rank: int
    world_size: int
    group: object = None  # the torch.distributed process group (None: the default group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """[..., sizes[rank]] from every rank -> [..., sum(sizes)] in rank order (gloo
        gathers equal shapes: shards are padded to the largest and cut back)."""
        if self.world_size == 1:
            return x
        width = max(sizes)
        padded = nn.functional.pad(x, (0, width - x.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([part[..., :n] for part, n in zip(parts, sizes)], dim=-1)


def check_divisible(cfg: ModelConfig, world_size: int) -> None:
    """ValueError naming the counts when the model cannot be split over world_size ranks."""
    kv = cfg.num_kv_heads
    kv_ok = kv % world_size == 0 if kv >= world_size else world_size % kv == 0
    if cfg.num_heads % world_size or not kv_ok or cfg.intermediate_size % world_size:
        raise ValueError(f"tensor parallel size {world_size} does not divide this model: {cfg.num_heads} attention "
                         f"heads, {kv} KV heads, intermediate size {cfg.intermediate_size} (the heads and the "
                         f"intermediate size must divide by it; KV heads must divide by it or divide it)")


def sharded_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The per-rank shapes: heads, KV heads (replicated ones count once a rank) and MLP width."""
    check_divisible(cfg, world_size)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // world_size,
                               num_kv_heads=max(1, cfg.num_kv_heads // world_size),
                               intermediate_size=cfg.intermediate_size // world_size)


VOCAB_UNIT = 16  # token ids: the vocabulary splits in whole blocks of a quantized LM head


def vocab_range(vocab_size: int, tp: TPGroup) -> tuple[int, int]:
    """The token ids [start, end) rank tp.rank holds: units of VOCAB_UNIT ids shared out
    evenly (the first ranks one more when uneven), the last rank's cut at vocab_size."""
    base, extra = divmod(-(-vocab_size // VOCAB_UNIT), tp.world_size)
    start = (tp.rank * base + min(tp.rank, extra)) * VOCAB_UNIT
    end = start + (base + (tp.rank < extra)) * VOCAB_UNIT
    return min(start, vocab_size), min(end, vocab_size)


class RowParallelLinear(nn.Module):
    """A linear layer over this rank's slice of the input features; the partial outputs of
    all ranks are summed (one all-reduce), so every rank gets the full output."""

    def __init__(self, local: nn.Linear, tp: TPGroup):
        super().__init__()
        assert local.bias is None, "row-parallel layers of these families have no bias"
        self.local, self.tp = local, tp

    @property
    def weight(self) -> torch.Tensor:
        return self.local.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.local(x))


class VocabParallelEmbedding(nn.Module):
    """The rows of the token ids [start, end); other ids embed to zero before the all-reduce."""

    def __init__(self, weight: torch.Tensor, start: int, tp: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [end - start, H]
        self.start, self.tp = start, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight.shape[0] == 0:  # a vocabulary smaller than VOCAB_UNIT ids a rank leaves some none
            return self.tp.all_reduce(self.weight.new_zeros(ids.shape[0], self.weight.shape[1]))
        local = ids - self.start  # [T]
        inside = (local >= 0) & (local < self.weight.shape[0])
        x = nn.functional.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)  # [T, H]
        return self.tp.all_reduce(x * inside.unsqueeze(-1).to(x.dtype))


class VocabParallelHead(nn.Module):
    """The LM head's rows of the token ids [start, end) (local: a linear layer of them); the
    logits' shards are gathered."""

    def __init__(self, local: nn.Module, vocab_size: int, tp: TPGroup):
        super().__init__()
        self.local, self.tp = local, tp
        self.sizes = [end - start for start, end in (vocab_range(vocab_size, TPGroup(r, tp.world_size))
                                                     for r in range(tp.world_size))]

    @property
    def weight(self) -> torch.Tensor:
        return self.local.weight  # [end - start, H]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(self.local(hidden), self.sizes)  # [N, V]


def _rows(linear: nn.Module, row_ranges: list[tuple[int, int]]) -> nn.Module:
    """A linear layer of the given row ranges of linear (weight and bias): a new one for a
    float layer, the same one for a quantized layer."""
    if isinstance(linear, QuantizedLinear):
        linear.keep_rows(row_ranges)
        return linear
    weight = torch.cat([linear.weight.data[a:b] for a, b in row_ranges])
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=linear.bias is not None,
                    device=weight.device, dtype=weight.dtype).requires_grad_(False)
    out.weight.data.copy_(weight)
    if linear.bias is not None:
        out.bias.data.copy_(torch.cat([linear.bias.data[a:b] for a, b in row_ranges]))
    return out


def _columns(linear: nn.Module, start: int, end: int) -> nn.Module:
    if isinstance(linear, QuantizedLinear):
        linear.keep_columns(start, end)
        return linear
    out = nn.Linear(end - start, linear.weight.shape[0], bias=False, device=linear.weight.device,
                    dtype=linear.weight.dtype).requires_grad_(False)
    out.weight.data.copy_(linear.weight.data[:, start:end])
    return out


def _shard_attention(attn, cfg: ModelConfig, tp: TPGroup) -> None:
    d, world, rank = cfg.head_dim, tp.world_size, tp.rank
    heads = cfg.num_heads // world
    if cfg.num_kv_heads >= world:
        kv_heads, first_kv = cfg.num_kv_heads // world, rank * (cfg.num_kv_heads // world)
    else:  # replicated: the KV head that this rank's q heads read
        kv_heads, first_kv = 1, rank // (world // cfg.num_kv_heads)
    q_size, kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
    q_rows = (rank * heads * d, (rank + 1) * heads * d)
    k_rows = (q_size + first_kv * d, q_size + (first_kv + kv_heads) * d)
    v_rows = (q_size + kv_size + first_kv * d, q_size + kv_size + (first_kv + kv_heads) * d)
    attn.qkv_proj = _rows(attn.qkv_proj, [q_rows, k_rows, v_rows])
    attn.o_proj = RowParallelLinear(_columns(attn.o_proj, *q_rows), tp)
    attn.num_heads, attn.num_kv_heads = heads, kv_heads
    attn.q_size, attn.kv_size = heads * d, kv_heads * d


def _shard_mlp(mlp, cfg: ModelConfig, tp: TPGroup) -> None:
    inter = cfg.intermediate_size
    width = inter // tp.world_size
    start = tp.rank * width
    mlp.gate_up_proj = _rows(mlp.gate_up_proj, [(start, start + width), (inter + start, inter + start + width)])
    mlp.down_proj = RowParallelLinear(_columns(mlp.down_proj, start, start + width), tp)
    mlp.intermediate_size = width


def shard_model(model, tp: TPGroup) -> None:
    """Keep rank tp.rank's shard of a loaded DecoderModel, in place."""
    cfg = model.config
    check_divisible(cfg, tp.world_size)
    linears = [model.lm_head] + [m for layer in model.layers for m in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    if any(type(m) is not nn.Linear and not isinstance(m, QuantizedLinear) for m in linears):
        raise ValueError("tensor parallelism takes float row-major or quantized weights, not prepacked ones "
                         "(cpu_weight_prepack=False)")
    if tp.world_size == 1:
        return
    for layer in model.layers:
        _shard_attention(layer.self_attn, cfg, tp)
        _shard_mlp(layer.mlp, cfg, tp)
    start, end = vocab_range(cfg.vocab_size, tp)
    head = _rows(model.lm_head, [(start, end)])
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight.data[start:end].clone(), start, tp)
    model.lm_head = VocabParallelHead(head, cfg.vocab_size, tp)
    model.config = dataclasses.replace(sharded_config(cfg, tp.world_size), vocab_size=cfg.vocab_size)
