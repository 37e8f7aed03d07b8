"""The EAGLE draft heads and their checkpoints: EAGLE-1/2's (Li et al. 2024) and EAGLE-3's
(Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test").

EagleHead (EAGLE-1/2) drafts at the feature level. Its input at position p is the
target's feature f_p (the final hidden state, the one the LM head reads) and the
embedding of the token at p + 1; `fc` projects their concatenation [embed, feature] to
the hidden size, one decoder layer (the target's shapes, no input norm) runs over the
head's own KV cache, and its output is a guess of f_{p+1}, which the target's LM head
turns into the token at p + 2. Drafting goes on from guessed features.

Eagle3Head (EAGLE-3) reads more of the target and guesses no feature. Its input at p is
the residual stream entering three target layers (low, middle, high; by default
2, L // 2 and L - 3, vLLM's choice) concatenated [3H], which `fc` projects to the
hidden size. Its one layer normalises the token embedding (input_layernorm) and that
state (hidden_norm) apart, attends from their concatenation [2H], and keeps the state as
the residual. Its output state goes through its own final norm and its own LM head over
a draft vocabulary (the most frequent tokens; draft id i is target token i + d2t[i]), and
is, as it is, the next drafting step's input state.

Both offer the proposer (speculators/eagle.py) and the trainer (training/eagle.py)
one interface:
  target_features(hidden [n, H']) -> [n, F]  the part of the target's hidden states it reads
                                              (ModelRunner.execute: final state, then layer inputs)
  project(features [n, F]) -> [n, h]        the input state made from the target's features
  forward(ids [T], positions [T], states [T, h], attention) -> [T, h]  the next states
  draft_logits(states [N, h]) -> [N, Vd]    float32, over the draft vocabulary
  target_ids(draft ids) / draft_ids(target ids, -100 outside the draft vocabulary)
  regresses_features: whether the states are guesses of the target's features (EAGLE-1)

Checkpoints, names mapped explicitly (ours are the public layouts):
  EAGLE-1/2: fc.weight [H, 2H], fc.bias [H] (optional), layers.0.self_attn.{q,k,v,o}_proj
    (+ q/k/v biases for Qwen2), layers.0.mlp.{gate,up,down}_proj,
    layers.0.post_attention_layernorm; the target's config.
  EAGLE-3: fc.weight [H, 3H], midlayer.self_attn.{q,k,v}_proj [*, 2H], midlayer.self_attn.o_proj,
    midlayer.mlp.*, midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}, norm,
    lm_head [Vd, H], d2t [Vd] (absent: the whole vocabulary), t2d (ignored); "layers.0."
    is accepted for "midlayer."; config.json ("LlamaForCausalLMEagle3") gives the layer's
    shapes, draft_vocab_size, eagle_aux_hidden_state_layer_ids (absent: the default) and
    norm_before_residual.
  embed_tokens.weight in either is ignored: the target's embedding is used.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from runtime.models.config import ModelConfig
from runtime.models.decoder import MLP, AttentionFn, Attention, DecoderLayer, RMSNorm, RotaryEmbedding
from runtime.models.packed_linear import apply_linear
from speculators.draft_vocab import DraftVocabulary

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layers (vLLM's default): the inputs of these."""
    layers = (2, num_layers // 2, num_layers - 3)
    if not 0 <= layers[0] < layers[1] < layers[2]:
        raise ValueError(f"a {num_layers}-layer target has no default EAGLE-3 feature layers; give them")
    return layers


# ---- EAGLE-1/2 --------------------------------------------------------------------------------

class EagleHead(nn.Module):
    """fc([embed(token), feature]) -> one decoder layer -> the next feature [T, H]."""

    regresses_features = True
    feature_layers: tuple[int, ...] = ()

    def __init__(self, target_config, embed_tokens: nn.Module, lm_head: nn.Module, fc_bias: bool = True):
        super().__init__()
        self.config = dataclasses.replace(target_config, num_layers=1)
        h = self.config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        layer = DecoderLayer(self.config, 0)
        layer.input_layernorm = nn.Identity()  # EAGLE's layer reads fc's output as it is
        self.layers = nn.ModuleList([layer])
        self.rotary = RotaryEmbedding(self.config)
        self._shared = (embed_tokens, lm_head)  # the target's; not submodules, not in state_dict

    @property
    def dtype(self) -> torch.dtype:  # a norm's: linear layers may be quantized (draft_cpu.backends)
        return self.layers[0].post_attention_layernorm.weight.dtype

    def set_shared(self, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        self._shared = (embed_tokens, lm_head)

    def target_features(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[..., :self.config.hidden_size]  # the final hidden state

    def project(self, features: torch.Tensor) -> torch.Tensor:
        return features

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                attention: AttentionFn) -> torch.Tensor:
        # input_ids, positions [T]; features [T, H] -> predicted next features [T, H]
        embeds = self._shared[0](input_ids).to(features.dtype)
        x = self.fc(torch.cat([embeds, features], dim=-1))
        cos, sin = self.rotary(positions, x.dtype)
        return self.layers[0](x, cos, sin, attention)

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        # [N, H] -> [N, V] float32, through the target's LM head, whatever its dtype and packing
        # (a float32 head in training shares a bf16 target's LM head: packed where bf16 math is native)
        return apply_linear(self._shared[1], features).float()

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        return target_ids

    def config_dict(self) -> dict:
        return {"architecture": "eagle", "hidden_size": self.config.hidden_size,
                "vocab_size": self.config.vocab_size, "fc_bias": self.fc.bias is not None,
                "target_architecture": self.config.architecture}


# ---- EAGLE-3 ----------------------------------------------------------------------------------

class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attends from [input_layernorm(embed), hidden_norm(state)]."""

    def __init__(self, cfg: ModelConfig, norm_before_residual: bool = False):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)  # on the incoming state
        self.self_attn = Attention(cfg, 0)
        self.self_attn.qkv_proj = nn.Linear(2 * h, self.self_attn.q_size + 2 * self.self_attn.kv_size,
                                            bias=cfg.attention_bias)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.norm_before_residual = norm_before_residual

    def forward(self, embeds, states, cos, sin, attention: AttentionFn):
        # embeds, states [T, h] -> [T, h]
        normed = self.hidden_norm(states)
        residual = normed if self.norm_before_residual else states
        x = residual + self.self_attn(torch.cat([self.input_layernorm(embeds), normed], dim=-1), cos, sin, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(DraftVocabulary, nn.Module):
    """fc(target layers' inputs) -> the state; [embed, state] -> one layer -> the next state."""

    regresses_features = False

    def __init__(self, config: ModelConfig, target_hidden_size: int, feature_layers: tuple[int, ...],
                 draft_vocab_size: int, embed_tokens: nn.Module, norm_before_residual: bool = False):
        super().__init__()
        self.config = dataclasses.replace(config, num_layers=1)
        h = self.config.hidden_size
        self.target_hidden_size = target_hidden_size
        self.feature_layers = tuple(feature_layers)
        self.fc = nn.Linear(len(feature_layers) * target_hidden_size, h, bias=False)
        self.midlayer = Eagle3Layer(self.config, norm_before_residual)
        self.norm = RMSNorm(h, self.config.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
        self.init_draft_vocab(config.vocab_size, draft_vocab_size)
        self.rotary = RotaryEmbedding(self.config)
        self._shared = (embed_tokens,)  # the target's; not a submodule, not in state_dict

    @property
    def dtype(self) -> torch.dtype:  # a norm's: linear layers may be quantized (draft_cpu.backends)
        return self.norm.weight.dtype

    def set_shared(self, embed_tokens: nn.Module, lm_head: nn.Module | None = None) -> None:
        self._shared = (embed_tokens,)

    def target_features(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[..., self.target_hidden_size:]  # the feature layers' inputs

    def project(self, features: torch.Tensor) -> torch.Tensor:
        # [n, k H_target] -> [n, h]
        return self.fc(features)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, states: torch.Tensor,
                attention: AttentionFn) -> torch.Tensor:
        # input_ids, positions [T]; states [T, h] -> next states [T, h] (before the final norm)
        embeds = self._shared[0](input_ids).to(states.dtype)
        cos, sin = self.rotary(positions, states.dtype)
        return self.midlayer(embeds, states, cos, sin, attention)

    def draft_logits(self, states: torch.Tensor) -> torch.Tensor:
        # [N, h] -> [N, Vd] float32
        return self.lm_head(self.norm(states)).float()

    def config_dict(self) -> dict:
        c = self.config
        return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
                "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
                "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
                "max_position_embeddings": c.max_position_embeddings, "attention_bias": c.attention_bias,
                "vocab_size": c.vocab_size, "draft_vocab_size": self.draft_vocab_size,
                "target_hidden_size": self.target_hidden_size,
                "eagle_aux_hidden_state_layer_ids": list(self.feature_layers),
                "norm_before_residual": self.midlayer.norm_before_residual}


def eagle3_config(head_config: dict, target_config: ModelConfig) -> ModelConfig:
    """The EAGLE-3 layer's shapes from its config.json; rotary tables as long as the target's."""
    cfg = ModelConfig.from_hf_dict({"model_type": "llama", **head_config, "num_hidden_layers": 1})
    return dataclasses.replace(cfg, vocab_size=target_config.vocab_size,
                               max_position_embeddings=max(cfg.max_position_embeddings,
                                                           target_config.max_position_embeddings))


def new_eagle3_head(target_config: ModelConfig, embed_tokens: nn.Module, draft_vocab: torch.Tensor,
                    feature_layers: tuple[int, ...] | None = None) -> Eagle3Head:
    """An untrained EAGLE-3 head with the target's layer shapes (Llama layout, no biases)
    over the draft vocabulary draft_vocab (target token ids, ascending)."""
    cfg = dataclasses.replace(target_config, architecture="llama", attention_bias=False, num_layers=1)
    head = Eagle3Head(cfg, target_config.hidden_size,
                      feature_layers or default_feature_layers(target_config.num_layers), len(draft_vocab),
                      embed_tokens)
    head.set_draft_vocab(draft_vocab)
    return head


# ---- public names ---------------------------------------------------------------------------------

def _fused_rows(cfg, prefix: str) -> dict[str, tuple[str, int, int]]:
    """Public name -> (our name, row offset, row count) for the fused q/k/v and gate/up matrices."""
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {f"{prefix}.self_attn.q_proj": (f"{prefix}.self_attn.qkv_proj", 0, q),
            f"{prefix}.self_attn.k_proj": (f"{prefix}.self_attn.qkv_proj", q, kv),
            f"{prefix}.self_attn.v_proj": (f"{prefix}.self_attn.qkv_proj", q + kv, kv),
            f"{prefix}.mlp.gate_proj": (f"{prefix}.mlp.gate_up_proj", 0, inter),
            f"{prefix}.mlp.up_proj": (f"{prefix}.mlp.gate_up_proj", inter, inter)}


def _layer_prefix(head) -> str:
    return "midlayer" if isinstance(head, Eagle3Head) else "layers.0"


def to_public_names(head) -> dict[str, torch.Tensor]:
    state = head.state_dict()
    fused = _fused_rows(head.config, _layer_prefix(head))
    out = {}
    for public, (ours, start, count) in fused.items():
        for leaf in ("weight", "bias"):
            if f"{ours}.{leaf}" in state:
                out[f"{public}.{leaf}"] = state[f"{ours}.{leaf}"].narrow(0, start, count)
    fused_names = {ours for ours, _, _ in fused.values()}
    for name, tensor in state.items():
        if name.rpartition(".")[0] not in fused_names:
            out[name] = tensor
    return out


def load_public_state(head, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Fill head from public-layout tensors; every parameter exactly once, shapes checked."""
    prefix = _layer_prefix(head)
    fused = _fused_rows(head.config, prefix)
    params = head.state_dict(keep_vars=True)  # parameters and saved buffers (d2t), by our names
    filled: set[str] = set()
    for name, tensor in tensors.items():
        if name in ("embed_tokens.weight", "t2d") or name.endswith("rotary_emb.inv_freq"):
            continue  # the target's embedding is used; t2d follows from d2t; rotary tables are computed
        if prefix == "midlayer" and name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0."):]
        if name == "layers.0.input_layernorm.weight":
            raise ValueError(f"{source}: this EAGLE head normalises its layer input (layers.0.input_layernorm) "
                             "but has no EAGLE-3 midlayer; only EAGLE-1/2 heads without it and EAGLE-3 heads "
                             "are supported")
        parent, _, leaf = name.rpartition(".")
        ours, start, count = fused.get(parent, (parent, None, None))
        target = f"{ours}.{leaf}" if ours else leaf
        if target not in params:
            raise ValueError(f"{source}: unexpected tensor {name!r} for this EAGLE head")
        dest = params[target].data if start is None else params[target].data.narrow(0, start, count)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"{source}: {name!r} has shape {tuple(tensor.shape)}, the target needs "
                             f"{tuple(dest.shape)}")
        dest.copy_(tensor)
        filled.add(name)
    expected = set(to_public_names(head))
    if isinstance(head, Eagle3Head) and "d2t" not in filled:
        expected.discard("d2t")  # no draft vocabulary: the whole target vocabulary, d2t = 0
    missing = sorted(expected - filled)
    if missing:
        raise ValueError(f"{source}: missing {', '.join(missing[:4])}" + (" ..." if len(missing) > 4 else ""))
    if isinstance(head, Eagle3Head):
        head.refresh_draft_vocab()


# ---- files ------------------------------------------------------------------------------------------

def save_head(head, directory: str | Path, extra_config: dict | None = None,
              dtype: torch.dtype | None = None) -> Path:
    """The head's weights (in dtype, e.g. bf16 for a checkpoint half the size; default the
    head's own) and config in the public layout; the target's shared weights are not saved."""
    from safetensors.torch import save_file
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {n: t.detach().to(dtype if dtype is not None and t.is_floating_point() else t.dtype).contiguous().cpu()
               for n, t in to_public_names(head).items()}
    save_file(tensors, str(directory / WEIGHTS_NAME))
    config = {**head.config_dict(), **({"torch_dtype": str(dtype).replace("torch.", "")} if dtype else {}),
              **(extra_config or {})}
    (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2))
    return directory


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        return load_file(str(path))
    return torch.load(str(path), map_location="cpu", weights_only=True)


def _weights_file(path: Path) -> Path:
    if path.is_dir():
        files = ([path / WEIGHTS_NAME] if (path / WEIGHTS_NAME).exists() else
                 sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin")))
        if not files:
            raise ValueError(f"no .safetensors or pytorch_model.bin in EAGLE checkpoint directory {str(path)!r}")
        return files[0]
    if path.exists():
        return path
    raise ValueError(f"EAGLE checkpoint {str(path)!r} does not exist")


def is_eagle3(tensors: dict, config: dict) -> bool:
    return ("LlamaForCausalLMEagle3" in config.get("architectures", []) or "d2t" in tensors
            or any(n.startswith("midlayer.") or n.endswith("hidden_norm.weight") for n in tensors))


def load_head(path: str | Path, target_config: ModelConfig, embed_tokens: nn.Module, lm_head: nn.Module):
    """An EAGLE-1/2 or EAGLE-3 head from a directory (model.safetensors, or any .safetensors or
    pytorch_model.bin in it) or a weights file, checked against the target's shapes."""
    weights = _weights_file(Path(path))
    tensors = _read_tensors(weights)
    config_file = weights.parent / CONFIG_NAME
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    if config.get("vocab_size") is not None and int(config["vocab_size"]) != target_config.vocab_size:
        raise ValueError(f"EAGLE checkpoint {str(path)!r} has vocab_size {config['vocab_size']}, the target "
                         f"{target_config.vocab_size}")
    if is_eagle3(tensors, config):
        head = _new_eagle3_from(config, tensors, target_config, embed_tokens, str(path))
    else:
        if "hidden_size" in config and int(config["hidden_size"]) != target_config.hidden_size:
            raise ValueError(f"EAGLE checkpoint {str(path)!r} has hidden_size {config['hidden_size']}, the target "
                             f"{target_config.hidden_size}")
        head = EagleHead(target_config, embed_tokens, lm_head, fc_bias="fc.bias" in tensors)
    load_public_state(head, tensors, str(weights))
    return head


def _new_eagle3_from(config: dict, tensors: dict, target_config: ModelConfig, embed_tokens, source: str):
    if "hidden_size" not in config:
        raise ValueError(f"EAGLE-3 checkpoint {source!r} needs its config.json (the layer's shapes)")
    cfg = eagle3_config(config, target_config)
    if cfg.hidden_size != target_config.hidden_size:
        raise ValueError(f"EAGLE-3 checkpoint {source!r} has hidden_size {cfg.hidden_size}, the target "
                         f"{target_config.hidden_size} (heads with their own embedding are not supported)")
    layers = tuple(config.get("eagle_aux_hidden_state_layer_ids")
                   or (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
                   or default_feature_layers(target_config.num_layers))
    if list(layers) != sorted(set(layers)) or not 0 <= layers[0] or layers[-1] >= target_config.num_layers:
        raise ValueError(f"EAGLE-3 checkpoint {source!r}: feature layers {list(layers)} do not fit a "
                         f"{target_config.num_layers}-layer target (ascending, within range)")
    lm_head = tensors.get("lm_head.weight")
    draft_vocab = int(config.get("draft_vocab_size") or (lm_head.shape[0] if lm_head is not None
                                                          else target_config.vocab_size))
    return Eagle3Head(cfg, target_config.hidden_size, layers, draft_vocab, embed_tokens,
                      bool(config.get("norm_before_residual", False)))
