"""HF checkpoints with a `quantization_config`: GPTQ and AWQ int4, and FP8, read into the
forms the decoder loads (runtime.models.quantized_weight.QuantizedWeight, or float).

  - GPTQ (quant_method "gptq", bits 4, no act-order): per linear layer `qweight` int32
    [K/8, N] (eight 4-bit inputs a word, the first in the low bits), `qzeros` int32 [G, N/8]
    (eight outputs a word), `scales` fp16 [G, N], `g_idx` [K]. w = s (q - z), where the
    stored zero is z - 1 in the original "gptq" checkpoint format and z in "gptq_v2".
  - AWQ (quant_method "awq", version "gemm"): `qweight` int32 [K, N/8] and `qzeros` int32
    [G, N/8], eight outputs a word in AWQ's interleaved order (0, 2, 4, 6, 1, 3, 5, 7),
    `scales` fp16 [G, N]. w = s (q - z).
  - FP8 (quant_method "fp8", e4m3): `weight` float8_e4m3fn [N, K] with `weight_scale`
    (per tensor, or per output row [N, 1]); w = weight * scale, upcast at load to the
    model's dtype (the log says so): there is no FP8 matmul kernel here yet.
Both int4 layouts become w = s q + o with o = -s z, group-wise along K as our int4 kernels
want; group sizes the kernels lack (a whole row, -1) are split into groups of 128 or less.
"""
from __future__ import annotations

import logging
from typing import Iterator

import torch

from runtime.models.quantized_weight import QuantizedWeight, UnsupportedQuantizationError

log = logging.getLogger(__name__)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # word nibble i holds output AWQ_ORDER[i] of its eight
KERNEL_GROUPS = (256, 128, 64, 32)
INT4_METHODS = ("gptq", "awq")  # loaded as int4 weight-only; fp8 is upcast on the CPU
SUPPORTED_METHODS = (*INT4_METHODS, "fp8")


def check_quantization_config(qc: dict) -> None:
    """A one-line error for a quantization_config this loader cannot read."""
    method = qc.get("quant_method")
    if method not in SUPPORTED_METHODS:
        raise UnsupportedQuantizationError(f"quantization_config with quant_method {method!r} is not supported "
                                           f"(supported: {', '.join(SUPPORTED_METHODS)})")
    if method in INT4_METHODS and qc.get("bits", 4) != 4:
        raise UnsupportedQuantizationError(f"{method} with {qc.get('bits')} bits is not supported (4 bits only)")
    if method == "gptq" and qc.get("desc_act"):
        raise UnsupportedQuantizationError("gptq with desc_act (act-order) is not supported")
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise UnsupportedQuantizationError(f"awq version {qc.get('version')!r} is not supported (gemm only)")
    if method == "fp8" and qc.get("weight_block_size"):
        raise UnsupportedQuantizationError("fp8 with weight_block_size (block-wise scales) is not supported")


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> [..., W, 8] 4-bit values, the lowest bits first."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return (words.unsqueeze(-1) >> shifts) & 0xF


def _kernel_groups(q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int, source: str):
    """QuantizedWeight with q [N, K] and [N, K / group] parameters, groups split to a size the
    int4 kernels take when needed (the parameters repeated)."""
    k = q.shape[1]
    size = next((g for g in KERNEL_GROUPS if group % g == 0 and k % g == 0), None)
    if size is None:
        raise UnsupportedQuantizationError(f"{source}: group size {group} with {k} inputs is not supported")
    repeat = group // size
    return QuantizedWeight(4, q.to(torch.uint8).contiguous(), scales.repeat_interleave(repeat, 1).contiguous(),
                           offsets.repeat_interleave(repeat, 1).contiguous(), size, source)


def gptq_weight(qweight, qzeros, scales, g_idx, qc: dict) -> QuantizedWeight:
    k = qweight.shape[0] * 8
    group = qc.get("group_size", -1)
    group = k if group in (-1, None) else group
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group):
        raise UnsupportedQuantizationError("gptq with a permuted g_idx (act-order) is not supported")
    q = _nibbles(qweight.t()).flatten(1)  # [N, K/8, 8] -> [N, K]
    zeros = _nibbles(qzeros).flatten(1).float()  # [G, N]
    if qc.get("checkpoint_format", "gptq") == "gptq":
        zeros = zeros + 1  # the original format stores z - 1
    s = scales.float()  # [G, N]
    return _kernel_groups(q, s.t(), (-s * zeros).t(), group, "gptq")


def awq_weight(qweight, qzeros, scales, qc: dict) -> QuantizedWeight:
    order = torch.tensor(AWQ_ORDER)
    inverse = torch.argsort(order)  # output j of a word sits in nibble inverse[j]

    def unpack(words):  # [R, N/8] -> [R, N]
        return _nibbles(words)[..., inverse].flatten(1)

    q = unpack(qweight).t()  # [N, K]
    zeros = unpack(qzeros).float()  # [G, N]
    s = scales.float()
    return _kernel_groups(q, s.t(), (-s * zeros).t(), qc.get("group_size", 128), "awq")


def fp8_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [N, K] with a per-tensor or per-row scale -> float32 [N, K]."""
    return weight.float() * scale.float().reshape(-1, 1) if scale.numel() > 1 else weight.float() * scale.float()


def hf_quantized_weights(tensors: Iterator[tuple[str, torch.Tensor]], qc: dict
                         ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """A quantized checkpoint's tensors as the decoder's HF-named weights: each layer's
    packed tensors become one `<layer>.weight` (a QuantizedWeight, or float for FP8)."""
    method = qc["quant_method"]
    layers: dict[str, dict[str, torch.Tensor]] = {}
    packed = ("qweight", "qzeros", "scales", "g_idx") if method != "fp8" else ("weight", "weight_scale")
    for name, tensor in tensors:
        prefix, _, leaf = name.rpartition(".")
        if leaf in packed and (method != "fp8" or tensor.dtype == torch.float8_e4m3fn or leaf == "weight_scale"):
            layers.setdefault(prefix, {})[leaf] = tensor
        else:
            yield name, tensor
    upcast = 0
    for prefix, parts in layers.items():
        if method == "gptq":
            yield f"{prefix}.weight", gptq_weight(parts["qweight"], parts["qzeros"], parts["scales"],
                                                  parts.get("g_idx"), qc)
        elif method == "awq":
            yield f"{prefix}.weight", awq_weight(parts["qweight"], parts["qzeros"], parts["scales"], qc)
        elif "weight_scale" in parts:
            upcast += 1
            yield f"{prefix}.weight", fp8_weight(parts["weight"], parts["weight_scale"])
        else:
            yield f"{prefix}.weight", parts["weight"].float()
    if upcast:
        log.info("fp8 checkpoint: %d linear weights upcast to the model's dtype at load (no FP8 kernel here)", upcast)
