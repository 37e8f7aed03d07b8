"""Weight-only quantized linear layers, and the one place that decides which kernel a linear
layer runs (`make_linear`; `linear_kernels` names them for the load log).

Kernels (activations stay in the model's dtype; only the weight is quantized):
  - Int4Linear, CPU: `aten._weight_int4pack_mm_for_cpu` (PyTorch's own AVX-512/AVX2 int4
    kernel, as torchao uses it). CUDA: `aten._weight_int4pack_mm` (tinygemm, bf16).
    Both compute w = (q - 8) s + z per group, so a QuantizedWeight's w = s q + o becomes
    z = o + 8 s, and both compute in bf16: scales and zeros are rounded to bf16 (a GGUF
    file's fp16 block scales lose 3 bits: the load log gives the weight error this adds),
    and activations are cast to bf16 for the call.
  - Inputs of more than MANY_ROWS rows (prefill chunks, large batches, verify trees), CPU,
    bf16: PyTorch's two CPU kernels dequantize the weight in registers again for each small
    block of rows and multiply with float32 FMAs, so their cost grows with the rows (at 128 rows, 2.5x a bf16 matmul).
    Above MANY_ROWS a layer runs this project's heterospec_cpu::dequant_gemm instead
    (runtime/models/cpu_kernels.py: each tile of the weight dequantized once per call into a
    bf16 GEMM). Int8 layers share their int8 weight with it; int4 layers keep a second copy
    of their nibbles in its layout (the weight's int4 bytes twice). Where the kernel cannot
    be built, PyTorch's kernels run at every row count (the load log says which).
  - DequantizedLinear: int4 and int8 weights of a float32 model, dequantized once at load
    exactly as ggml does (s q + o, float32) into a float32 matmul: float32 is the exactness
    mode (the tests' reference), which the int4 kernels' bf16 rounding would break; the CPU
    kernels' float32 variants are not vectorised (the int8 one 20x slower at 16 rows), and
    dequantizing per call cost more than the float32 weight's reads. So a float32 model
    holds float32 weights, as with --quantization none, and the load log says so.
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

from runtime.models.cpu_kernels import dequant_gemm_available
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


MANY_ROWS = 24  # more rows than this: dequant_gemm (crossover 16-32 rows: scripts/bench_quant_linear.py)
TILE_BYTES = 1 << 20  # dequant_gemm's bf16 weight tile (best of 256 KiB .. 16 MiB on 2 MiB of L2)


def dequant_gemm_layout_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] of 0..15 -> uint8 [N, K/2]: in each group of 32 weights, byte j holds weight j
    (low nibble) and weight j + 16 (high nibble)."""
    n, k = q.shape
    halves = q.view(n, k // 32, 2, 16).to(torch.uint8)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


class QuantizedLinear(nn.Module):
    """Shared by the int4 and int8 layers: shapes, bias, and a float view of the weight for
    set-up code that reads one (a head sharing the target's LM head); never on a hot path."""

    kernel = ""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype, self.source, self.error = dtype, weight.source, weight.error
        self.group_size = weight.group_size
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

    def _keep_for_many_rows(self, weight: QuantizedWeight, device: torch.device, dtype: torch.dtype,
                            many_rows: int | None) -> int | None:
        """Keep dequant_gemm's scales and offsets where it runs (the CPU, bf16 activations, the
        kernel built); the rows above which it runs, or None."""
        align = 32 if weight.bits == 4 else 16
        if (many_rows is None or device.type != "cpu" or dtype != torch.bfloat16 or weight.shape[1] % align
                or weight.group_size % align or not dequant_gemm_available()):
            return None
        self.register_buffer("gemm_scales", weight.scales.float().contiguous().to(device))  # [N, K/group]
        offsets = None if weight.offsets is None else weight.offsets.float().contiguous().to(device)
        self.register_buffer("gemm_offsets", offsets)  # [N, K/group]
        self.kernel += f" (<= {many_rows} rows), heterospec_cpu.dequant_gemm (more)"
        return many_rows

    def _takes_op(self, x2: torch.Tensor) -> bool:
        """Whether x2 goes through heterospec_cpu.quant_linear: above many_rows rows, and
        always inside a compiled graph (no branch on the row count there); an eager call of
        few rows takes PyTorch's kernel directly (the op's dispatch costs ~2 us a layer)."""
        return self.many_rows is not None and (torch.compiler.is_compiling() or x2.shape[0] > self.many_rows)

    def _quant_linear(self, x2: torch.Tensor, q: torch.Tensor, small_weight: torch.Tensor,
                      small_scales: torch.Tensor) -> torch.Tensor:
        """x2 bf16 [M, K] -> [M, N]: PyTorch's kernel up to many_rows rows, dequant_gemm (over q,
        the weight in its layout) above."""
        return torch.ops.heterospec_cpu.quant_linear(x2, q, self.gemm_scales, self.gemm_offsets,
                                                    self.bits, self.group_size, small_weight, small_scales,
                                                    self.many_rows, TILE_BYTES)

    def _finish(self, y: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, kernel={self.kernel}, source={self.source}")


class Int4Linear(QuantizedLinear):
    bits = 4

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device, many_rows: int | None = MANY_ROWS):
        """many_rows: inputs of more rows run dequant_gemm on the CPU (None: never)."""
        super().__init__(weight, bias, dtype, device)
        if weight.bits != 4:
            raise ValueError("Int4Linear needs a 4-bit weight")
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
        self.many_rows = None if self.on_cuda else self._keep_for_many_rows(weight, device, dtype, many_rows)
        if self.many_rows is not None:
            self.register_buffer("gemm_q", dequant_gemm_layout_int4(weight.q).to(device))  # [N, K/2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)  # [M, K]
        if self.on_cuda:
            y = torch.ops.aten._weight_int4pack_mm(x2, self.packed_weight, self.group_size, self.scales_and_zeros)
        elif self._takes_op(x2):
            y = self._quant_linear(x2, self.gemm_q, self.packed_weight, self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed_weight, self.group_size,
                                                           self.scales_and_zeros)
        return self._finish(y.to(x.dtype), shape)  # [..., N]


class DequantizedLinear(QuantizedLinear):
    """A float32 model's int4/int8 weight, dequantized once at load exactly as ggml does
    (s q + o in float32): float32 is the exactness mode, so it keeps float32's memory and
    speed (dequantizing per call instead cost a 0.5B model 6x its decode speed)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device):
        super().__init__(weight, bias, dtype, device)
        self.kernel = f"int{weight.bits} dequantized to float32 at load"
        self.register_buffer("dequantized", weight.dequantize().to(device))  # [N, K] float32

    def dequantize(self) -> torch.Tensor:
        return self.dequantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.dequantized.to(x.dtype), self.bias)


class Int8Linear(QuantizedLinear):
    """Per-row int8. With float_layer (and max_int8_rows) set, inputs of more rows than
    max_int8_rows run through float_layer instead; without, through dequant_gemm above
    many_rows rows (the CPU, bf16; None: never)."""

    bits = 8

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device, float_layer: nn.Module | None = None, max_int8_rows: int | None = None,
                 many_rows: int | None = MANY_ROWS):
        super().__init__(weight, bias, dtype, device)
        if weight.bits != 8 or weight.offsets is not None or weight.group_size != self.in_features:
            raise ValueError("Int8Linear needs a symmetric 8-bit weight with one scale per row")
        self.register_buffer("weight_int8", weight.q.to(device))  # [N, K]
        self.register_buffer("scales", weight.scales[:, 0].to(device, dtype))  # [N]
        self.float_layer, self.max_int8_rows = float_layer, max_int8_rows
        self.has_int8_kernel = device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm")
        self.kernel = "int8 aten._weight_int8pack_mm" if self.has_int8_kernel else "int8 dequantizing matmul"
        self.many_rows = None if float_layer is not None or not self.has_int8_kernel else \
            self._keep_for_many_rows(weight, device, dtype, many_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [M, K]
        if self.float_layer is not None and self.max_int8_rows is not None and x2.shape[0] > self.max_int8_rows:
            return self.float_layer(x)
        if self._takes_op(x2):
            y = self._quant_linear(x2, self.weight_int8, self.weight_int8, self.scales)
        elif self.has_int8_kernel:
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
        if dtype == torch.float32:
            return DequantizedLinear(weight, bias, dtype, device)
        if weight.bits == 8:
            return Int8Linear(weight, bias, dtype, device)
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
