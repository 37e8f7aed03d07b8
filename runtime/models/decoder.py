"""One decoder for the Llama family (SmolLM2, Llama 2/3), Mistral and Qwen2/Qwen2.5.

Pre-norm transformer: RMSNorm, rotary position embeddings (Su et al. 2021, "RoFormer")
with the config's theta and scaling, grouped-query attention (Ainslie et al. 2023) and a
SwiGLU MLP (Shazeer 2020). Per-family switches live in ModelConfig (q/k/v bias for
Qwen2, tied embeddings). Attention over the KV cache is not done here: every layer hands
its q/k/v to an attention backend (target_gpu.attention), which writes k/v into the paged
cache and attends over the cached context with the step's masks. So prefill, decode and
tree verification are the same forward: "these tokens, at these positions, this mask".

Tokens of all sequences in a step are flattened into one ragged batch: tensors are
[T, ...] where T is the step's total number of new tokens.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
from torch import nn

from runtime.models.config import ModelConfig, UnsupportedModelError
from runtime.models.quantized_weight import QuantizedWeight, quantize_int8

# attention(layer_idx, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in float32, scale in the model dtype (as HF does)
        x32 = nn.functional.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [D/2] after the config's rope scaling (none, linear, llama3)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    raise UnsupportedModelError(f"rope scaling {kind!r} is not supported (supported: linear, llama3)")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, looked up by the tokens' positions."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inv_freq = rope_inv_freq(cfg)
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T] -> cos, sin [T, 1, D]
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, H, D]; rotate_half convention (GPT-NeoX / HF)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, attention: AttentionFn):
        t = x.shape[0]
        qkv = self.qkv_proj(x).view(t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk = apply_rope(qkv[:, :self.num_heads + self.num_kv_heads], cos, sin)  # [T, Hq+Hkv, D], one call
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, Hq, D], [T, Hkv, D]
        v = qkv[:, self.num_heads + self.num_kv_heads:]  # [T, Hkv, D]
        out = attention(self.layer_idx, q, k, v)  # [T, Hq, D]
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, attention: AttentionFn):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn,
                feature_layers: tuple[int, ...] = ()) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (after the last norm).

        With feature_layers (j_1..j_k, EAGLE-3's auxiliary layers): [T, (1 + k) hidden], the
        final hidden states followed by the residual stream entering layer j_i (0 = the
        embeddings), the same as HF's output_hidden_states[j_i]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        features = []
        for i, layer in enumerate(self.layers):
            if i in feature_layers:
                features.append(x)
            x = layer(x, cos, sin, attention)
        x = self.norm(x)
        return torch.cat([x] + features, dim=-1) if features else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [N, hidden] -> logits [N, V] in float32
        return self.lm_head(hidden).float()

    # ---- weights -------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, "torch.Tensor | QuantizedWeight"]]) -> None:
        """Load HF-named tensors (model.layers.N.self_attn.q_proj.weight, ...).

        q/k/v and gate/up are fused here into qkv_proj and gate_up_proj; every shape is
        checked, and every parameter must be filled exactly once. A linear weight given as a
        QuantizedWeight (runtime.models.quantized_weight) replaces its layer by the kernel
        that quant_linear.make_linear picks (a fused layer's parts are stacked; parts of
        different bits are all taken to the most bits). An lm_head.weight given quantized is
        loaded even with tied embeddings: the embedding keeps its float table. A float part
        of a fused layer whose other parts are quantized is quantized to int8 with them.
        """
        cfg = self.config
        params = dict(self.named_parameters())
        filled: set[str] = set()
        quantized: dict[str, list[tuple[int, QuantizedWeight]]] = {}  # layer path -> (row offset, part)
        float_parts: dict[str, list[tuple[int, torch.Tensor]]] = {}  # fused layers' float parts
        fused = fused_linears(cfg)
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings and not isinstance(tensor, QuantizedWeight):
                continue
            target, rows = _map_hf_name(name, fused)
            if target not in params and not (target == "lm_head.weight" and isinstance(tensor, QuantizedWeight)):
                raise UnsupportedModelError(f"unexpected weight {name!r} (mapped to {target!r})")
            dest_shape = self.get_submodule(target.rsplit(".", 1)[0]).weight.shape if isinstance(
                tensor, QuantizedWeight) else params[target].shape
            expected = (rows[1], *dest_shape[1:]) if rows is not None else tuple(dest_shape)
            if tuple(tensor.shape) != tuple(expected):
                raise UnsupportedModelError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}")
            if isinstance(tensor, QuantizedWeight):
                quantized.setdefault(target.rsplit(".", 1)[0], []).append((0 if rows is None else rows[0], tensor))
            else:
                dest = params[target].data
                (dest if rows is None else dest.narrow(0, rows[0], rows[1])).copy_(tensor)
                if rows is not None and target.endswith(".weight"):
                    float_parts.setdefault(target.rsplit(".", 1)[0], []).append((rows[0], tensor))
            filled.add(name)
        expected_names = _expected_hf_names(cfg)
        missing = sorted(expected_names - filled)
        if missing:
            raise UnsupportedModelError(f"missing weights: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        for path, parts in quantized.items():
            parts += [(row, quantize_int8(t, f"{str(t.dtype)[6:]} quantized")) for row, t in float_parts.get(path, [])]
            self._set_linear(path, _stack_parts([part for _, part in sorted(parts, key=lambda p: p[0])]))

    def _set_linear(self, path: str, weight: "torch.Tensor | QuantizedWeight") -> None:
        """Replace the linear layer at `path` by make_linear's choice for `weight` (its bias kept)."""
        from runtime.models.quant_linear import make_linear
        parent_path, _, attr = path.rpartition(".")
        parent = self.get_submodule(parent_path) if parent_path else self
        old = getattr(parent, attr)
        bias = None if old.bias is None else old.bias.detach()
        setattr(parent, attr, make_linear(weight, bias, self.dtype, self.embed_tokens.weight.device))


def fused_linears(cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """HF name suffix -> (our layer, row offset, row count) within a fused layer."""
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
        "self_attn.k_proj": ("self_attn.qkv_proj", q, kv),
        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, kv),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
        "mlp.up_proj": ("mlp.gate_up_proj", inter, inter),
    }


def _stack_parts(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """One quantized weight from a fused layer's parts; parts of fewer bits are requantized to
    the most bits among them (Q4_K_M files keep some v projections in Q6_K, for instance)."""
    if len(parts) == 1:
        return parts[0]
    bits = max(p.bits for p in parts)
    if any(p.bits != bits for p in parts):
        parts = [p if p.bits == bits else quantize_int8(p.dequantize(), f"{p.source} as int8") for p in parts]
    return QuantizedWeight.cat_rows(parts)


def _map_hf_name(name: str, fused: dict) -> tuple[str, tuple[int, int] | None]:
    if name.startswith("model."):
        name = name[len("model."):]
    for hf, (ours, start, count) in fused.items():
        if f".{hf}." in f".{name}":
            return name.replace(hf, ours), (start, count)
    return name, None


def _expected_hf_names(cfg: ModelConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names |= {p + s for s in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                  "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                  "mlp.down_proj.weight")}
        if cfg.attention_bias:
            names |= {p + f"self_attn.{x}_proj.bias" for x in "qkv"}
    return names
