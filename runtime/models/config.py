"""The decoder's hyper-parameters, read from an HF config.json or from GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass, field

# Families that share the one decoder in decoder.py, and what differs between them.
#   attention_bias: q/k/v projections carry a bias (Qwen2).
SUPPORTED_ARCHITECTURES = {
    "llama": dict(attention_bias=False),
    "mistral": dict(attention_bias=False),
    "qwen2": dict(attention_bias=True),
}


class UnsupportedModelError(ValueError):
    """A model we were pointed at exists but cannot be run by this decoder."""


@dataclass(slots=True)
class ModelConfig:
    architecture: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Mistral / Qwen2 sliding-window attention: each token sees its last `sliding_window`
    # positions, itself included (the reference attention backend and the compiled decode step)
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported "
                f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        """Build from a parsed HF config.json (transformers 4.x and 5.x layouts)."""
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported "
                f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope_scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None and isinstance(rope_scaling, dict):
            rope_theta = rope_scaling.get("rope_theta")
        if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        window = cfg.get("sliding_window")
        if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
            window = None
        layers = cfg["num_hidden_layers"]
        if model_type == "qwen2" and window is not None:  # HF: layers from max_window_layers on are windowed
            first_windowed = cfg.get("max_window_layers", layers)
            if first_windowed >= layers:
                window = None
            elif first_windowed > 0:
                raise UnsupportedModelError(f"sliding window on layers {first_windowed} and up only "
                                            f"(max_window_layers): one window for every layer is supported")
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architecture=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", SUPPORTED_ARCHITECTURES[model_type]["attention_bias"])),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=window,
        )

