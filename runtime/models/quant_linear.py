"""Weight-only quantized linear layers, and the one place that decides which kernel a linear
layer runs (`make_linear`; `linear_kernels` names them for the load log).

Kernels:
  - CPU, bf16 activations (the default dtype wherever the CPU has bf16 math), every int4 and
    int8 layer whose shape allows (16 | N, 32 | K and the group): this project's
    heterospec_cpu.quant_linear over the weight in its blocked layout (one copy;
    runtime/models/cpu_kernels.py builds it). Up to many_rows rows, the activations are
    quantized to int8 per block of 32 (as llama.cpp does on the CPU) and integer dot
    products run on the packed bytes (AVX-512 VNNI, else AVX2; a CPU with neither keeps
    PyTorch's kernels below); above, tiles of the weight are
    dequantized into a bf16 GEMM (default_many_rows: only CPUs with AMX go there). PyTorch's
    own int4/int8 CPU kernels dequantize each weight to float32 in registers for each small
    block of rows and multiply with float32 FMAs, so their cost grows with the rows: a whole
    model's layers took 1.1-1.2x this kernel's time on one row (both near the memory
    bandwidth), 1.8-2x at 16 rows, 2.6-3x from 64 (scripts/bench_quant_linear.py).
  - Int4Linear elsewhere. CPU: `aten._weight_int4pack_mm_for_cpu` (PyTorch's own AVX-512/AVX2
    int4 kernel, as torchao uses it). CUDA: `aten._weight_int4pack_mm` (tinygemm, bf16).
    Both compute w = (q - 8) s + z per group, so a QuantizedWeight's w = s q + o becomes
    z = o + 8 s, and both compute in bf16: scales and zeros are rounded to bf16 (a GGUF
    file's fp16 block scales lose 3 bits: the load log gives the weight error this adds),
    and activations are cast to bf16 for the call. Where the CPU kernel cannot be built (no
    compiler), these run, and the load log says so.
  - DequantizedLinear: int4 and int8 weights of a float32 model, dequantized once at load
    exactly as ggml does (s q + o, float32) into a float32 matmul: float32 is the exactness
    mode (the tests' reference), which the int4 kernels' bf16 rounding would break; the CPU
    kernels' float32 variants are not vectorised (the int8 one 20x slower at 16 rows), and
    dequantizing per call cost more than the float32 weight's reads. So a float32 model
    holds float32 weights, as with --quantization none, and the load log says so.
  - Int8Linear elsewhere, CPU: `aten._weight_int8pack_mm` (per-row scales); elsewhere a
    dequantizing matmul. With a float layer kept beside it (the draft's --draft-quantization int8 on a
    float model), inputs of more rows than int8 wins at run through the float layer.
  - float weights: PackedLinear (oneDNN's blocked layout, bf16 on CPUs with bf16 math) or
    a plain nn.Linear.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

import torch
from torch import nn

from runtime.models.cpu_kernels import has_vector_kernel, kernel_isa
from runtime.models.packed_linear import PackedLinear, can_prepack
from runtime.models.quantized_weight import QuantizedWeight, relative_rms_error, sample_rows
from runtime.platform import amx_available


def cuda_int4_inner_k_tiles(in_features: int) -> int:
    """tinygemm's inner K tiles for this K: the largest of 8, 4, 2 that divides K / 16."""
    for tiles in (8, 4, 2):
        if in_features % (tiles * 16) == 0:
            return tiles
    raise ValueError(f"the CUDA int4 kernel needs in_features divisible by 32, got {in_features}")


def rounded_scales_error(weight: QuantizedWeight, dtype: torch.dtype, zero_shift: int = 0) -> float:
    """Relative RMS error that a kernel's rounding of the scales and zeros to dtype adds to the
    weight, against the exact s q + o (float32), on sample rows. The kernel's zero is
    o + zero_shift s: PyTorch's int4 kernels compute (q - 8) s + z (zero_shift 8),
    heterospec_cpu.quant_linear s q + o (zero_shift 0)."""
    exact = weight.permute_rows(sample_rows(weight.q.shape[0]))
    scales = exact.scales.to(dtype).float()
    offsets = exact.offsets
    if offsets is not None or zero_shift:
        zeros = (torch.zeros_like(exact.scales) if offsets is None else offsets) + zero_shift * exact.scales
        offsets = zeros.to(dtype).float() - zero_shift * scales
    rounded = dataclasses.replace(exact, scales=scales, offsets=offsets)
    return relative_rms_error(rounded.dequantize(), exact.dequantize())


MANY_ROWS_AMX = 32  # more rows than this: the bf16 GEMM regime, on CPUs with AMX
NO_GEMM = 1 << 62  # many_rows that never takes the GEMM regime


def default_many_rows() -> int:
    """The rows above which heterospec_cpu.quant_linear dequantizes tiles into a bf16 GEMM.
    With AMX the GEMM wins from a few dozen rows (its dequantization costs as much as ~35 rows
    of dot products); with AVX-512 BF16 alone the int8 dot products won at every row count
    measured, 1 to 512 (scripts/bench_quant_linear.py), so they run at every row count."""
    return MANY_ROWS_AMX if amx_available() else NO_GEMM


TILE_BYTES = 1 << 20  # the GEMM regime's bf16 weight tile (best of 256 KiB .. 16 MiB on 2 MiB of L2)
BLOCK = 16  # outputs per block of the blocked layout


def blocked_layout(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """heterospec_cpu.quant_linear's layout (kernels/quant_linear.cpp): 16 outputs x 4
    consecutive k per 64 bytes. Returns q uint8 [N/16, K*8] (int4: two weights a byte, k 4
    apart) or [N/16, K*16] (int8, stored + 128), scales and offsets float16 [N/16, G, 16]."""
    n, k = weight.shape
    if weight.bits == 4:
        w = weight.q.to(torch.uint8).view(n // BLOCK, BLOCK, k // 32, 4, 2, 4)  # [b, i, kb, c, nibble, j]
        q = (w[..., 0, :] | (w[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)  # [b, kb, c, i, j]
    else:
        u = (weight.q.to(torch.int16) + 128).to(torch.uint8).view(n // BLOCK, BLOCK, k // 4, 4)  # [b, i, t, j]
        q = u.permute(0, 2, 1, 3)  # [b, t, i, j]
    q = q.contiguous().view(n // BLOCK, -1)

    def per_block(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [N/16, G, 16]
        return t.half().view(n // BLOCK, BLOCK, -1).transpose(1, 2).contiguous()

    return q, per_block(weight.scales), None if weight.offsets is None else per_block(weight.offsets)


def can_use_blocked(weight: QuantizedWeight, device: torch.device, dtype: torch.dtype) -> bool:
    n, k = weight.shape
    in_half_range = all(t is None or t.abs().max().item() < torch.finfo(torch.float16).max
                        for t in (weight.scales, weight.offsets))
    return (device.type == "cpu" and dtype == torch.bfloat16 and n % BLOCK == 0 and k % 32 == 0
            and weight.group_size % 32 == 0 and in_half_range and has_vector_kernel())


class QuantizedLinear(nn.Module):
    """Shared by the int4 and int8 layers: shapes, bias, heterospec_cpu.quant_linear where it
    runs, and a float view of the weight for set-up code that reads one (a head sharing the
    target's LM head); never on a hot path."""

    kernel = ""
    many_rows: int | None = None  # None: PyTorch's kernels; else heterospec_cpu.quant_linear's GEMM above it

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

    def _pack_blocked(self, weight: QuantizedWeight, device: torch.device, dtype: torch.dtype,
                      many_rows: int | None | str) -> bool:
        """Pack the weight for heterospec_cpu.quant_linear where it runs (the CPU, bf16
        activations, the kernel built, 16 | N, 32 | K and the group); whether it did."""
        if many_rows is None or not can_use_blocked(weight, device, dtype):
            return False
        many_rows = default_many_rows() if many_rows == "auto" else many_rows
        q, scales, offsets = blocked_layout(weight)
        # fp16 scales: exact for GGUF's Q4_0/Q4_1 (fp16 block scales), not for Q4_K (fp16 x 6-bit products)
        self.error = (self.error ** 2 + rounded_scales_error(weight, torch.float16) ** 2) ** 0.5
        self.register_buffer("block_q", q.to(device))  # [N/16, K*8 | K*16]
        self.register_buffer("block_scales", scales.to(device))  # [N/16, G, 16]
        self.register_buffer("block_offsets", None if offsets is None else offsets.to(device))
        self.many_rows = many_rows
        self.kernel = f"int{weight.bits} heterospec_cpu.quant_linear ({kernel_isa()}, int8 activations" + (
            ")" if many_rows >= NO_GEMM else f" <= {many_rows} rows, bf16 GEMM above)")
        return True

    def _quant_linear(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, K] -> bf16 [M, N]: heterospec_cpu.quant_linear over the blocked weight."""
        # .default: the overload itself (resolving it from the packet cost ~1 us a call)
        return torch.ops.heterospec_cpu.quant_linear.default(x2.to(torch.bfloat16), self.block_q, self.block_scales,
                                                            self.block_offsets, self.bits, self.group_size,
                                                            self.many_rows, TILE_BYTES)

    # ---- tensor parallelism's split (runtime.models.tensor_parallel), in place --------------
    def _split_layout(self) -> dict:
        """Buffer name -> (output rows per entry of dim 0, k -> index along dim 1, or None when
        dim 1 does not run along the inputs); ValueError where the kernel's layout is opaque."""
        per_group = None if self.group_size == self.in_features else (lambda k: k // self.group_size)
        if self.many_rows is not None:  # the blocked layout: 16 outputs an entry, 2 * bits bytes per k
            return {"block_q": (BLOCK, lambda k: k * 2 * self.bits), "block_scales": (BLOCK, per_group),
                    "block_offsets": (BLOCK, per_group)}
        raise ValueError(f"a {self.kernel} layer cannot be split across tensor-parallel ranks")

    def keep_rows(self, ranges: list[tuple[int, int]]) -> None:
        """Keep the output rows [a, b) of each range, in order (the column-parallel split)."""
        layout = self._split_layout()
        unit = max(rows for rows, _ in layout.values())
        if any(a % unit or b % unit for a, b in ranges):
            raise ValueError(f"{self.kernel}: output rows {ranges} are not whole blocks of {unit} rows")
        for name, (rows, _) in layout.items():
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, torch.cat([t[a // rows:b // rows] for a, b in ranges]).contiguous())
        if self.bias is not None:
            self.bias = nn.Parameter(torch.cat([self.bias[a:b] for a, b in ranges]), requires_grad=False)
        self.out_features = sum(b - a for a, b in ranges)

    def keep_columns(self, start: int, end: int) -> None:
        """Keep the input features [start, end) (the row-parallel split). A weight of one group
        a row (int8) keeps its scales; else the slice must hold whole groups."""
        layout = self._split_layout()
        unit = 32 if self.many_rows is not None else 1  # the blocked kernel's k blocks
        if self.group_size != self.in_features:
            unit = max(unit, self.group_size)
        if start % unit or end % unit:
            raise ValueError(f"{self.kernel}: input features [{start}, {end}) are not whole groups of {unit}")
        for name, (_, index) in layout.items():
            t = getattr(self, name)
            if t is not None and index is not None:
                setattr(self, name, t[:, index(start):index(end)].contiguous())
        if self.group_size == self.in_features:
            self.group_size = end - start
        self.in_features = end - start

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
                 device: torch.device, many_rows: int | None | str = "auto"):
        """many_rows: on the CPU, heterospec_cpu.quant_linear with its GEMM regime above this
        many rows ("auto": default_many_rows(); 0: always the GEMM; NO_GEMM: never; None:
        PyTorch's int4 kernel instead)."""
        super().__init__(weight, bias, dtype, device)
        if weight.bits != 4:
            raise ValueError("Int4Linear needs a 4-bit weight")
        self.on_cuda = device.type == "cuda"
        if self.on_cuda or not self._pack_blocked(weight, device, dtype, many_rows):
            self._pack_for_pytorch(weight, device)

    def _pack_for_pytorch(self, weight: QuantizedWeight, device: torch.device) -> None:
        offsets = weight.offsets if weight.offsets is not None else torch.zeros_like(weight.scales)
        zeros = offsets + 8 * weight.scales  # [N, G]: the kernels' w = (q - 8) s + z
        # [G, N, 2]: per group, every output's scale and zero
        scales_and_zeros = torch.stack([weight.scales.t(), zeros.t()], dim=-1).to(torch.bfloat16)
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous().to(device))
        bf16_error = rounded_scales_error(weight, torch.bfloat16, zero_shift=8)
        self.error = (self.error ** 2 + bf16_error ** 2) ** 0.5
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
        x2 = x.reshape(-1, shape[-1])  # [M, K]
        if self.many_rows is not None:
            y = self._quant_linear(x2)
        elif self.on_cuda:  # the kernels take a contiguous input (not a view of EAGLE-3's wider hidden states)
            y = torch.ops.aten._weight_int4pack_mm(x2.to(torch.bfloat16).contiguous(), self.packed_weight,
                                                   self.group_size, self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16).contiguous(), self.packed_weight,
                                                           self.group_size, self.scales_and_zeros)
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

    def _split_layout(self) -> dict:
        return {"dequantized": (1, lambda k: k)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.dequantized.to(x.dtype), self.bias)


class Int8Linear(QuantizedLinear):
    """Per-row int8. On the CPU with bf16 activations, heterospec_cpu.quant_linear (many_rows as
    Int4Linear's), else PyTorch's int8 kernel. With float_layer (and max_int8_rows) set,
    inputs of more rows than max_int8_rows run through float_layer instead."""

    bits = 8

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device, float_layer: nn.Module | None = None, max_int8_rows: int | None = None,
                 many_rows: int | None | str = "auto"):
        super().__init__(weight, bias, dtype, device)
        if weight.bits != 8 or weight.offsets is not None or weight.group_size != self.in_features:
            raise ValueError("Int8Linear needs a symmetric 8-bit weight with one scale per row")
        self.float_layer, self.max_int8_rows = float_layer, max_int8_rows
        if not self._pack_blocked(weight, device, dtype, many_rows):
            self.register_buffer("weight_int8", weight.q.to(device))  # [N, K]
            self.register_buffer("scales", weight.scales[:, 0].to(device, dtype))  # [N]
            self.has_int8_kernel = device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm")
            self.kernel = "int8 aten._weight_int8pack_mm" if self.has_int8_kernel else "int8 dequantizing matmul"

    def _split_layout(self) -> dict:
        if self.float_layer is not None:
            raise ValueError("an int8 layer with a float layer beside it cannot be split across ranks")
        if self.many_rows is not None:
            return super()._split_layout()
        return {"weight_int8": (1, lambda k: k), "scales": (1, None)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [M, K]
        if self.float_layer is not None and self.max_int8_rows is not None and x2.shape[0] > self.max_int8_rows:
            return self.float_layer(x)
        if self.many_rows is not None:
            y = self._quant_linear(x2).to(x.dtype)
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
