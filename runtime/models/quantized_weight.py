"""Group-wise quantized linear weights: what a quantized file holds, in one form for every kernel.

A QuantizedWeight is a linear layer's weight [N, K] (N outputs, K inputs) as small integers
with one scale and one offset per group of `group_size` consecutive inputs of a row:

    w[n, k] = scales[n, g] * q[n, k] + offsets[n, g],   g = k // group_size

int4: q in 0..15 (uint8, one value a byte here; the kernels pack two a byte).
int8: q in -127..127 (int8), symmetric (no offsets), one group per row.

GGUF blocks unpack into this form without rounding where the formats map (`from_gguf`):
  Q4_0  w = d (q - 8)             -> int4, group 32, scale d, offset -8 d
  Q4_1  w = d q + m               -> int4, group 32, scale d, offset m
  Q4_K  w = d sc q - dmin m       -> int4, group 32, scale d sc, offset -dmin m (256-blocks of 8 groups)
and are requantized where they do not:
  Q5_K (and Q2_K, Q3_K)           -> int4, group 32
  Q8_0, Q6_K, Q5_0, Q5_1          -> int8, one scale per row (block scales to a row scale)
The requantization error (relative RMS, measured on up to 256 rows) is returned with the
weight, for the load log.
Block layouts are ggml's (llama.cpp's ggml-common.h); the tests check every exact unpacking
bit for bit against the `gguf` package's own dequantize.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

INT4_GROUP = 32  # group size of int4 weights made here (GGUF's block size)

# GGUF types by the precision class they keep: int4 group-wise, int8, or float (bf16)
GGUF_INT4_EXACT = ("Q4_0", "Q4_1", "Q4_K")
GGUF_INT4_REQUANT = ("Q5_K", "Q2_K", "Q3_K")
# Q5_0/Q5_1 go to int8: requantized to int4 they cost Qwen2.5-Coder-0.5B's Q4_K_M file (whose
# dims fall back from K-quants to Q5_0) 4.4% perplexity against llama.cpp's, int8 0.5%
GGUF_INT8 = ("Q8_0", "Q6_K", "Q5_0", "Q5_1")
GGUF_FLOAT = ("F32", "F16", "BF16")


class UnsupportedQuantizationError(ValueError):
    """A quantized tensor or checkpoint layout this runtime cannot run."""


@dataclass(slots=True)
class QuantizedWeight:
    bits: int  # 4 | 8
    q: torch.Tensor  # [N, K] uint8 0..15 (bits 4) | int8 -127..127 (bits 8)
    scales: torch.Tensor  # [N, K // group_size] float32
    offsets: torch.Tensor | None  # [N, K // group_size] float32; None: symmetric (w = s q)
    group_size: int
    source: str  # where it came from, e.g. "Q4_1", "Q6_K requantized", "bf16 quantized"
    error: float = 0.0  # relative RMS error against the source weight (0: exact)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """The weight [N, K] in float32, computed as ggml's dequantize computes it (s q + o)."""
        n, k = self.q.shape
        scales = self.scales.repeat_interleave(self.group_size, dim=1)  # [N, K]
        w = scales * self.q.float()
        if self.offsets is not None:
            w = w + self.offsets.repeat_interleave(self.group_size, dim=1)
        return w

    def narrow_rows(self, start: int, count: int) -> "QuantizedWeight":
        return QuantizedWeight(self.bits, self.q[start:start + count], self.scales[start:start + count],
                               None if self.offsets is None else self.offsets[start:start + count],
                               self.group_size, self.source, self.error)

    def permute_rows(self, order: torch.Tensor) -> "QuantizedWeight":
        """Rows reordered or picked (order: row indices); groups run along K, so nothing else moves."""
        return QuantizedWeight(self.bits, self.q[order], self.scales[order],
                               None if self.offsets is None else self.offsets[order],
                               self.group_size, self.source, self.error)

    @staticmethod
    def cat_rows(parts: list["QuantizedWeight"]) -> "QuantizedWeight":
        """Stack the rows of weights of one format (a fused q/k/v or gate/up layer)."""
        first = parts[0]
        if any(p.bits != first.bits or p.group_size != first.group_size or p.q.shape[1] != first.q.shape[1]
               or (p.offsets is None) != (first.offsets is None) for p in parts):
            raise ValueError("cat_rows needs weights of one format")
        sources = sorted({p.source for p in parts})
        rows = [p.q.shape[0] for p in parts]
        error = float(np.sqrt(sum(p.error ** 2 * r for p, r in zip(parts, rows)) / sum(rows)))
        return QuantizedWeight(first.bits, torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]),
                               None if first.offsets is None else torch.cat([p.offsets for p in parts]),
                               first.group_size, "+".join(sources), error)


# ---- quantizing float weights ----------------------------------------------------------------

ERROR_SAMPLE_ROWS = 256  # rows the load log's error figures are measured on (evenly spaced)


def sample_rows(num_rows: int) -> torch.Tensor:
    """Evenly spaced row indices, at most ERROR_SAMPLE_ROWS of them: error figures are for the
    load log, and measuring them on every row of a large model took longer than the load."""
    return torch.linspace(0, num_rows - 1, min(num_rows, ERROR_SAMPLE_ROWS)).round().long()


def relative_rms_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt().clamp_min(1e-30))


def quantize_int4(weight: torch.Tensor, source: str, group_size: int = INT4_GROUP) -> QuantizedWeight:
    """Asymmetric min-max int4 per group of `group_size` inputs: scale (max - min) / 15,
    offset min. weight [N, K] (K a multiple of group_size)."""
    w = weight.float()
    n, k = w.shape
    if k % group_size:
        raise UnsupportedQuantizationError(f"int4 needs in_features divisible by {group_size}, got {k}")
    groups = w.view(n, k // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [N, G]
    scales = ((high - low) / 15).clamp_min(1e-10)
    q = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8).view(n, k)
    out = QuantizedWeight(4, q, scales, low, group_size, source)
    rows = sample_rows(n)
    out.error = relative_rms_error(out.permute_rows(rows).dequantize(), w[rows])
    return out


def quantize_int8(weight: torch.Tensor, source: str) -> QuantizedWeight:
    """Symmetric int8 with one scale per output row: absmax / 127."""
    w = weight.float()
    scales = (w.abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-10)  # [N, 1]
    q = torch.round(w / scales).clamp(-127, 127).to(torch.int8)
    out = QuantizedWeight(8, q, scales, None, w.shape[1], source)
    rows = sample_rows(w.shape[0])
    out.error = relative_rms_error(out.permute_rows(rows).dequantize(), w[rows])
    return out


# ---- GGUF blocks -----------------------------------------------------------------------------

def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 bytes [..., 2] -> float32 [...]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: the low nibbles are elements 0..15, the high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _unpack_q4_0(blocks: np.ndarray):
    d = _f16(blocks[..., 0:2])  # [R, B]
    return _nibbles_32(blocks[..., 2:18]), d, -8 * d


def _unpack_q4_1(blocks: np.ndarray):
    return _nibbles_32(blocks[..., 4:20]), _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])


def _k_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> [..., 8] each (ggml's get_scale_min_k4)."""
    s = scales.astype(np.uint8)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _unpack_q4_k(blocks: np.ndarray):
    # block of 256: d (2), dmin (2), scales (12), qs (128): 4 chunks of 32 bytes, each the low
    # nibbles of one group of 32 then the high nibbles of the next
    rows, nb = blocks.shape[:2]
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [R, B]
    sc, mn = _k_scales_mins(blocks[..., 4:16])  # [R, B, 8]
    qs = blocks[..., 16:144].reshape(rows, nb, 4, 1, 32)
    q = ((qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F).reshape(rows, nb * 8, 32)
    scales = (d[..., None] * sc).reshape(rows, nb * 8)
    offsets = -(dmin[..., None] * mn).reshape(rows, nb * 8)
    return q, scales, offsets


_EXACT_INT4 = {"Q4_0": (18, _unpack_q4_0), "Q4_1": (20, _unpack_q4_1), "Q4_K": (144, _unpack_q4_k)}


def gguf_int4_exact(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """Unpack GGUF Q4_0 / Q4_1 / Q4_K blocks (raw: [N, bytes per row] uint8) into int4 with
    group 32, exactly: dequantize() equals ggml's dequantization bit for bit."""
    n, k = shape
    block_bytes, unpack = _EXACT_INT4[type_name]
    values_per_block = 256 if type_name == "Q4_K" else 32
    blocks = raw.reshape(n, k // values_per_block, block_bytes)
    q, scales, offsets = unpack(blocks)
    q = torch.from_numpy(np.ascontiguousarray(q).reshape(n, k).astype(np.uint8))
    return QuantizedWeight(4, q, torch.from_numpy(np.ascontiguousarray(scales).reshape(n, k // 32)),
                           torch.from_numpy(np.ascontiguousarray(offsets).reshape(n, k // 32)), 32, type_name)


def _fp16_scale(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """[B, bytes] uint8 -> the fp16 at bytes start..start+2 of each block as float32 [B, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Block of 32: d (fp16), 32 int8 values."""
    return _fp16_scale(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()


def _dequantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """Block of 32: d (fp16), qh (the 32 high bits, little-endian), qs (16 bytes: low nibbles are
    values 0..15, high 16..31)."""
    qh = blocks[:, 2:6]  # [B, 4] bytes: bit j of the 32-bit word is value j's high bit
    high = ((qh[:, :, None] >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(-1, 32)  # [B, 32]
    low = torch.cat([blocks[:, 6:22] & 0x0F, blocks[:, 6:22] >> 4], dim=1)  # [B, 32]
    q = (low | (high << 4)).view(torch.int8) - 16  # -16..15
    return _fp16_scale(blocks, 0) * q.float()


def _dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Block of 256: ql (128: low 4 bits), qh (64: high 2 bits), 16 int8 scales, d (fp16);
    d * scale first, then times q, as the gguf package computes it."""
    nb = blocks.shape[0]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [B, 16]
    ql = (blocks[:, :128].reshape(nb, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)) & 0x0F
    qh = (blocks[:, 128:192].reshape(nb, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3
    q = (ql.reshape(nb, 8, 32) | (qh.reshape(nb, 8, 32) << 4)).view(torch.int8) - 32  # [B, 8, 32] in -32..31
    return (_fp16_scale(blocks, 208) * scales).view(nb, 16, 1) * q.view(nb, 16, 16).float()


# the types most of a K-quant file's requantized bytes are in: (bytes per block, dequantizer)
_TORCH_DEQUANTIZE = {"Q8_0": (34, _dequantize_q8_0), "Q5_0": (22, _dequantize_q5_0), "Q6_K": (210, _dequantize_q6_k)}


def gguf_dequantize(raw: np.ndarray, type_name: str) -> torch.Tensor:
    """A GGUF tensor's data (GGUFTensor.data: [..., bytes per row]) in float32 [..., values per
    row], a fresh tensor, bit for bit what the gguf package computes: Q8_0, Q5_0 and Q6_K with
    torch's threads, Q4_0/Q4_1/Q4_K through their int4 unpacking (2-5x gguf's numpy), the rest
    by gguf."""
    if type_name in _TORCH_DEQUANTIZE:
        block_bytes, dequantize_blocks = _TORCH_DEQUANTIZE[type_name]
        blocks = torch.from_numpy(np.array(raw)).view(-1, block_bytes)  # [B, bytes] (a writable copy)
        return dequantize_blocks(blocks).reshape(*raw.shape[:-1], -1)
    if type_name in _EXACT_INT4:
        block_bytes = _EXACT_INT4[type_name][0]
        rows = raw.reshape(-1, raw.shape[-1])
        k = rows.shape[1] // block_bytes * (256 if type_name == "Q4_K" else 32)
        return gguf_int4_exact(rows, type_name, (rows.shape[0], k)).dequantize().reshape(*raw.shape[:-1], k)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    return torch.from_numpy(np.array(dequantize(raw, GGMLQuantizationType[type_name]), dtype=np.float32))


def gguf_quantized(raw: np.ndarray, type_name: str, shape: tuple[int, int], bits: int,
                   dense: torch.Tensor | None = None) -> QuantizedWeight:
    """A GGUF linear weight [N, K] as `bits` (4 | 8): unpacked exactly where the formats map,
    else dequantized (dense: already, by the caller) and requantized (the error recorded)."""
    if bits == 4 and type_name in _EXACT_INT4 and shape[1] % 32 == 0:
        return gguf_int4_exact(raw, type_name, shape)
    dense = (gguf_dequantize(raw, type_name) if dense is None else dense).reshape(shape)
    requant = quantize_int4 if bits == 4 else quantize_int8
    return requant(dense, f"{type_name} {'requantized' if type_name not in GGUF_FLOAT else 'quantized'}")


def gguf_precision_bits(type_name: str) -> int | None:
    """The bits a GGUF tensor type keeps under --quantization auto: 4, 8, or None (float)."""
    if type_name in GGUF_INT4_EXACT or type_name in GGUF_INT4_REQUANT:
        return 4
    if type_name in GGUF_INT8:
        return 8
    if type_name in GGUF_FLOAT:
        return None
    raise UnsupportedQuantizationError(f"GGUF tensor type {type_name} is not supported "
                                       f"(supported: {', '.join(GGUF_INT4_EXACT + GGUF_INT4_REQUANT + GGUF_INT8 + GGUF_FLOAT)})")
