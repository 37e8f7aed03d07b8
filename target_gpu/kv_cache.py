"""The paged KV cache pool: per layer, K and V tensors of [num_blocks, block_size, Hkv, D].

A token's slot is block_id * block_size + offset; runtime.block_manager hands out block
ids, this module only owns the memory and sizes it.
"""
from __future__ import annotations

import logging
import re

import psutil
import torch

from runtime.models.config import ModelConfig

log = logging.getLogger("target_gpu.kv_cache")

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30}


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def parse_memory(spec: str | int | float | None, device: torch.device, default_fraction: float) -> int:
    """'2GiB', '500MB', 1073741824 -> bytes; a number in (0, 1] is a fraction of free memory."""
    if spec is None:
        return int(default_fraction * free_memory_bytes(device))
    if isinstance(spec, str):
        match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", spec)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"--kv-cache-memory: cannot read {spec!r} (examples: 2GiB, 500MB, 0.2)")
        number, unit = float(match.group(1)), match.group(2).lower()
        if not unit and number <= 1.0:
            return int(number * free_memory_bytes(device))
        return int(number * _UNITS[unit])
    if 0 < spec <= 1.0:
        return int(spec * free_memory_bytes(device))
    return int(spec)


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * element


def num_kv_blocks(cfg: ModelConfig, block_size: int, dtype: torch.dtype, memory: str | int | float | None,
                  device: torch.device, default_fraction: float) -> tuple[int, int]:
    """(blocks that the memory spec holds, bytes per block); ValueError when none fits."""
    per_block = bytes_per_block(cfg, block_size, dtype)
    pool_bytes = parse_memory(memory, device, default_fraction)
    if pool_bytes < per_block:
        raise ValueError(f"KV cache memory of {pool_bytes} bytes holds no block (one block is {per_block} bytes)")
    return pool_bytes // per_block, per_block


def mirror_pool_blocks(num_tokens: int, block_size: int, per_block: int, device: torch.device,
                       memory_fraction: float, what: str) -> int:
    """Blocks of a KV pool that follows the target's sequences (a draft model's, an EAGLE
    head's): enough for num_tokens, but at most what memory_fraction of the device's free
    memory holds (at least one block). A sequence the pool has no room for gets no drafts."""
    wanted = max(1, -(-num_tokens // block_size))
    fits = int(memory_fraction * free_memory_bytes(device)) // per_block
    if fits < wanted:
        log.info("%s KV cache: %d of the %d tokens that would mirror the target's pool fit in %.0f%% of %s's free "
                 "memory; sequences past them are not drafted for", what, max(fits, 1) * block_size,
                 wanted * block_size, 100 * memory_fraction, device)
    return max(1, min(wanted, fits))


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """K/V of slots src [N] -> slots dst [N], every layer (src is read before dst is written)."""
        for cache in (*self.k, *self.v):
            flat = cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, Hkv, D]
            flat.index_copy_(0, dst, flat.index_select(0, src))
