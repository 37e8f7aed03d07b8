"""heterospec_cpu::dequant_gemm and quant_linear (runtime/models/cpu_kernels.py), and the
choice between them and PyTorch's weight-only kernels in Int4Linear / Int8Linear.

- dequant_gemm computes x W^T for the weight that gguf's own dequantize gives (Q4_0, Q4_1
  made by gguf's quantize; int8 per row), up to the bf16 rounding of the weight and the
  output, over ragged tiles, groups of 32 and 128, and any row count.
- A layer takes PyTorch's kernel up to many_rows rows and dequant_gemm above, inside one op,
  so a compiled graph with a dynamic row count compiles once; each choice can be forced
  (many_rows=0: always dequant_gemm; None: never), and both agree.
- Where the kernel cannot be built (no compiler), the layers keep PyTorch's kernels at every
  row count, and the load log says so.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from runtime.models import quant_linear
from runtime.models.cpu_kernels import dequant_gemm_available
from runtime.models.quant_linear import Int4Linear, Int8Linear, dequant_gemm_layout_int4, linear_kernels
from runtime.models.quantized_weight import QuantizedWeight, gguf_int4_exact, quantize_int4, quantize_int8

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(not dequant_gemm_available(), reason="the CPU kernel did not build here")


def gguf_weight(type_name: str, n: int, k: int, seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    """A GGUF int4 weight made by gguf's quantize, and gguf's own dequantization of it [n, k]."""
    rows = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = quantize(rows, GGMLQuantizationType[type_name])
    return gguf_int4_exact(raw, type_name, (n, k)), torch.from_numpy(dequantize(raw, GGMLQuantizationType[type_name]))


def bf16_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight^T with the weight rounded to bf16 as the kernel stores its tiles."""
    return x.float() @ weight.bfloat16().float().t()


def close_to(out: torch.Tensor, reference: torch.Tensor) -> None:
    torch.testing.assert_close(out.float(), reference, atol=2e-2 * reference.abs().max().item(), rtol=1e-2)


@needs_kernel
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_dequant_gemm_int4_is_ggufs_weight(type_name, rows):
    weight, reference = gguf_weight(type_name, 200, 256)  # 200 outputs: ragged 16-row tiles below
    x = torch.randn(rows, 256, dtype=torch.bfloat16)
    offsets = weight.offsets if weight.offsets is not None else torch.zeros_like(weight.scales)
    out = torch.ops.heterospec_cpu.dequant_gemm(x, dequant_gemm_layout_int4(weight.q), weight.scales.float(),
                                                offsets.float(), 4, 32, 16 * 256 * 2)  # 16-row tiles
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 200)
    close_to(out, bf16_product(x, reference))


@needs_kernel
@pytest.mark.parametrize("bits,group", [(4, 128), (8, 384)])
def test_dequant_gemm_groups_and_int8(bits, group):
    w = torch.randn(70, 384) * 0.05
    weight = quantize_int4(w, "x", group_size=group) if bits == 4 else quantize_int8(w, "x")
    assert weight.group_size == group
    q = dequant_gemm_layout_int4(weight.q) if bits == 4 else weight.q
    x = torch.randn(33, 384, dtype=torch.bfloat16)
    out = torch.ops.heterospec_cpu.dequant_gemm(x, q, weight.scales.float(),
                                                None if weight.offsets is None else weight.offsets.float(),
                                                bits, group, 1 << 20)
    close_to(out, bf16_product(x, weight.dequantize()))


def layer(bits: int, many_rows: int | None):
    torch.manual_seed(0)
    w = torch.randn(96, 256) * 0.05
    bias = torch.randn(96) * 0.1
    if bits == 4:
        return Int4Linear(quantize_int4(w, "x"), bias, torch.bfloat16, CPU, many_rows=many_rows)
    return Int8Linear(quantize_int8(w, "x"), bias, torch.bfloat16, CPU, many_rows=many_rows)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_layers_choose_by_rows_and_each_choice_can_be_forced(bits):
    pytorch_only, always, default = layer(bits, None), layer(bits, 0), layer(bits, 24)
    assert "dequant_gemm" not in pytorch_only.kernel and pytorch_only.many_rows is None
    assert "dequant_gemm" in default.kernel and default.many_rows == 24
    for rows in (1, 24, 25, 64):
        x = torch.randn(rows, 256, dtype=torch.bfloat16)
        reference = pytorch_only(x).float()  # PyTorch's kernel
        close_to(always(x), reference)  # dequant_gemm
        close_to(default(x), reference)
        # the default layer takes exactly one of the two paths: PyTorch's up to 24 rows
        assert torch.equal(default(x), (pytorch_only if rows <= 24 else always)(x))


@needs_kernel
def test_compiled_layer_compiles_once_over_row_counts():
    from torch._dynamo.testing import CompileCounter
    int4 = layer(4, 24)
    counter = CompileCounter()
    compiled = torch.compile(int4, backend=counter, dynamic=True)
    with torch.inference_mode():
        for rows in (3, 40, 5, 100):
            x = torch.randn(rows, 256, dtype=torch.bfloat16)
            assert torch.equal(compiled(x), int4(x))
    assert counter.frame_count == 1


def test_without_the_kernel_layers_keep_pytorchs_kernels(monkeypatch):
    monkeypatch.setattr(quant_linear, "dequant_gemm_available", lambda: False)
    int4, int8 = layer(4, 24), layer(8, 24)
    assert int4.many_rows is None and int8.many_rows is None
    assert "dequant_gemm" not in linear_kernels(torch.nn.Sequential(int4, int8))
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    assert int4(x).shape == int8(x).shape == (64, 96)


def test_a_failed_build_is_a_warning_not_an_error(tmp_path):
    """No compiler: dequant_gemm_available() is False, with the reason logged."""
    code = ("import logging; logging.basicConfig(level=logging.WARNING)\n"
            "from runtime.models.cpu_kernels import dequant_gemm_available\n"
            "print('available', dequant_gemm_available())")
    env = dict(os.environ, CXX="/bin/false", HETEROSPEC_CACHE_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "available False" in run.stdout
    assert "dequant_gemm" in run.stderr and "unavailable" in run.stderr
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-built left behind
