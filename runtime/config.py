"""Engine configuration, validated once at start."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.models.loader import DEFAULT_MODEL


def amx_available() -> bool:
    try:
        return bool(torch._C._cpu._is_amx_tile_supported())
    except AttributeError:
        return False


@dataclass(slots=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context length (capped by the pool)
    block_size: int = 16
    kv_cache_memory: str | int | float | None = None  # bytes, "2GiB", or a fraction of free memory
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        return device

    def resolved_dtype(self, device: torch.device) -> str:
        """auto: bfloat16 on CUDA and on CPUs with AMX (4x faster matmuls), float32 otherwise."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if device.type == "cuda" or amx_available() else "float32"

    def kv_cache_default_fraction(self, device: torch.device) -> float:
        return 0.8 if device.type == "cuda" else 0.1
