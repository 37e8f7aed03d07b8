"""Weight-only quantized linear layers, and the one place that decides which kernel a linear
layer runs (`make_linear`; `linear_kernels` names them for the load log).

Kernels (activations stay in the model's dtype; only the weight is quantized):
  - Int4Linear, CPU: `aten._weight_int4pack_mm_for_cpu` (PyTorch's own AVX-512/AVX2 int4
    kernel, as torchao uses it). CUDA: `aten._weight_int4pack_mm` (tinygemm, bf16).
    Both compute w = (q - 8) s + z per group, so a QuantizedWeight's w = s q + o becomes
    z = o + 8 s, and both compute in bf16: scales and zeros are rounded to bf16 (a GGUF
    file's fp16 block scales lose 3 bits: the load log gives the weight error this adds),
    and activations are cast to bf16 for the call.
  - DequantizingLinear: int4 weights of a float32 model, dequantized per call exactly as
    ggml does (s q + o, float32) into a float32 matmul. float32 is the exactness mode (the
    tests' reference); the int4 kernels' bf16 rounding would break it, and the CPU
    kernel's float32 variant is not vectorised (slower than dequantizing at every row
    count).
  - Int8Linear, CPU: `aten._weight_int8pack_mm` (per-row scales); elsewhere a dequantizing
    matmul. With a float layer kept beside it (the draft's --draft-quantization int8 on a
    float model), inputs of more rows than int8 wins at run through the float layer.
  - float weights: PackedLinear (oneDNN's blocked layout, bf16 on CPUs with bf16 math) or
    a plain nn.Linear.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from runtime.models.packed_linear import PackedLinear, can_prepack
from runtime.models.quantized_weight import QuantizedWeight, relative_rms_error, sample_rows


def cuda_int4_inner_k_tiles(in_features: int) -> int:
    """tinygemm's inner K tiles for this K: the largest of 8, 4, 2 that divides K / 16."""
    for tiles in (8, 4, 2):
        if in_features % (tiles * 16) == 0:
            return tiles
    raise ValueError(f"the CUDA int4 kernel needs in_features divisible by 32, got {in_features}")


def bf16_scale_error(weight: QuantizedWeight, scales_and_zeros: torch.Tensor) -> float:
    """Relative RMS error of the weight the int4 kernels compute, (q - 8) s + z with s and z
    in bf16 (scales_and_zeros [G, N, 2]), against the exact s q + o (float32), on sample rows."""
    rows = sample_rows(weight.q.shape[0])
    sz = scales_and_zeros[:, rows].float()
    scales = sz[..., 0].t().repeat_interleave(weight.group_size, dim=1)  # [R, K]
    zeros = sz[..., 1].t().repeat_interleave(weight.group_size, dim=1)
    exact = weight.permute_rows(rows)
    return relative_rms_error((exact.q.float() - 8) * scales + zeros, exact.dequantize())


class QuantizedLinear(nn.Module):
    """Shared by the int4 and int8 layers: shapes, bias, and a float view of the weight for
    set-up code that reads one (a head sharing the target's LM head); never on a hot path."""

    kernel = ""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype, self.source, self.error = dtype, weight.source, weight.error
        self.bias = None if bias is None else nn.Parameter(bias.to(device, dtype), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """The weight [N, K] dequantized to the layer's dtype (computed on each access)."""
        return self.dequantize()

    @torch.inference_mode()
    def dequantize(self) -> torch.Tensor:
        """The weight [N, K] as the kernel computes it: the layer applied to the identity."""
        eye = torch.eye(self.in_features, device=self.packed_device(), dtype=self.dtype)  # [K, K]
        y = self.forward(eye)  # [K, N]
        if self.bias is not None:
            y = y - self.bias
        return y.t().contiguous()

    def packed_device(self) -> torch.device:
        return next(self.buffers()).device

    def _finish(self, y: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, kernel={self.kernel}, source={self.source}")


class Int4Linear(QuantizedLinear):
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device):
        super().__init__(weight, bias, dtype, device)
        if weight.bits != 4:
            raise ValueError("Int4Linear needs a 4-bit weight")
        self.group_size = weight.group_size
        offsets = weight.offsets if weight.offsets is not None else torch.zeros_like(weight.scales)
        zeros = offsets + 8 * weight.scales  # [N, G]: the kernels' w = (q - 8) s + z
        self.on_cuda = device.type == "cuda"
        # [G, N, 2]: per group, every output's scale and zero
        scales_and_zeros = torch.stack([weight.scales.t(), zeros.t()], dim=-1).to(torch.bfloat16)
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous().to(device))
        self.error = (self.error ** 2 + bf16_scale_error(weight, scales_and_zeros) ** 2) ** 0.5
        q = weight.q.to(device)
        if self.on_cuda:
            packed = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # [N, K/2]
            self.register_buffer("packed_weight", torch.ops.aten._convert_weight_to_int4pack(
                packed, cuda_int4_inner_k_tiles(self.in_features)))
            self.kernel = "int4 aten._weight_int4pack_mm (tinygemm)"
        else:
            self.register_buffer("packed_weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1))
            self.kernel = "int4 aten._weight_int4pack_mm_for_cpu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)  # [M, K]
        if self.on_cuda:
            y = torch.ops.aten._weight_int4pack_mm(x2, self.packed_weight, self.group_size, self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed_weight, self.group_size,
                                                           self.scales_and_zeros)
        return self._finish(y.to(x.dtype), shape)  # [..., N]


class DequantizingLinear(QuantizedLinear):
    kernel = "int4 dequantized per call (float32)"

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device):
        super().__init__(weight, bias, dtype, device)
        self.group_size = weight.group_size
        offsets = weight.offsets if weight.offsets is not None else torch.zeros_like(weight.scales)
        self.register_buffer("q", weight.q.to(device))  # [N, K]
        self.register_buffer("scales", weight.scales.to(device))  # [N, G]
        self.register_buffer("offsets", offsets.to(device))  # [N, G]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.q.shape
        g = self.group_size
        w = (self.scales[..., None] * self.q.view(n, k // g, g).float() + self.offsets[..., None]).view(n, k)
        return nn.functional.linear(x, w.to(x.dtype), self.bias)


class Int8Linear(QuantizedLinear):
    """Per-row int8. With float_layer (and max_int8_rows) set, inputs of more rows than
    max_int8_rows run through float_layer instead."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device, float_layer: nn.Module | None = None, max_int8_rows: int | None = None):
        super().__init__(weight, bias, dtype, device)
        if weight.bits != 8 or weight.offsets is not None or weight.group_size != self.in_features:
            raise ValueError("Int8Linear needs a symmetric 8-bit weight with one scale per row")
        self.register_buffer("weight_int8", weight.q.to(device))  # [N, K]
        self.register_buffer("scales", weight.scales[:, 0].to(device, dtype))  # [N]
        self.float_layer, self.max_int8_rows = float_layer, max_int8_rows
        self.has_int8_kernel = device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm")
        self.kernel = "int8 aten._weight_int8pack_mm" if self.has_int8_kernel else "int8 dequantizing matmul"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [M, K]
        if self.float_layer is not None and self.max_int8_rows is not None and x2.shape[0] > self.max_int8_rows:
            return self.float_layer(x)
        if self.has_int8_kernel:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.weight_int8, self.scales.to(x2.dtype))
        else:
            y = nn.functional.linear(x2, self.weight_int8.to(x2.dtype)) * self.scales.to(x2.dtype)
        return self._finish(y, shape)


def float_linear(weight: torch.Tensor, bias: torch.Tensor | None, prepack: bool = True) -> nn.Module:
    """A float layer over weight [N, K] (already in its dtype and on its device): prepacked for
    oneDNN where it can be, else an nn.Linear sharing the tensors."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=weight.dtype)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    if prepack and can_prepack(weight.dtype, weight.device):
        return PackedLinear(linear)
    return linear


def make_linear(weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                device: torch.device, prepack: bool = True) -> nn.Module:
    """The one place that decides which kernel a linear layer gets, from its weight's form."""
    if isinstance(weight, QuantizedWeight):
        if weight.bits == 8:
            return Int8Linear(weight, bias, dtype, device)
        if dtype == torch.float32:
            return DequantizingLinear(weight, bias, dtype, device)
        return Int4Linear(weight, bias, dtype, device)
    return float_linear(weight.to(device, dtype), None if bias is None else bias.to(device, dtype), prepack)


def kernel_name(module: nn.Module) -> str:
    if isinstance(module, QuantizedLinear):
        return module.kernel
    if isinstance(module, PackedLinear):
        return f"{str(module.packed_weight.dtype)[6:]} oneDNN prepacked"
    return f"{str(module.weight.dtype)[6:]} aten.linear"


def linear_kernels(model: nn.Module) -> str:
    """e.g. '181 int4 aten._weight_int4pack_mm_for_cpu (Q4_1), 30 int8 ... (Q6_K requantized,
    rel. RMS error 0.8%)': the kernels the model's linear layers run, for the load log."""
    counts: Counter[tuple[str, str]] = Counter()
    errors: dict[tuple[str, str], float] = {}
    for module in model.modules():
        if isinstance(module, (nn.Linear, PackedLinear, QuantizedLinear)):
            source = getattr(module, "source", "")
            key = (kernel_name(module), source)
            counts[key] += 1
            errors[key] = max(errors.get(key, 0.0), getattr(module, "error", 0.0))
    parts = []
    for (kernel, source), count in sorted(counts.items()):
        detail = source + (f", rel. RMS error up to {errors[(kernel, source)]:.2%}" if errors[(kernel, source)] else "")
        parts.append(f"{count} {kernel}" + (f" ({detail})" if detail else ""))
    return ", ".join(parts)
