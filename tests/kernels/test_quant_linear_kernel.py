"""heterospec_cpu::quant_linear (runtime/models/kernels/quant_linear.cpp), its blocked layout,
and the choice of kernels in Int4Linear / Int8Linear.

- Few rows: the activations quantized to int8 per block of 32, integer dot products on the
  packed weight. Checked against the same arithmetic written here in float64 on the weight
  that gguf's own dequantize gives (Q4_0, Q4_1 made by gguf's quantize; int4 groups of 128;
  int8 per row), and against the exact product within int8 activations' error.
- Many rows: tiles of the weight dequantized into a bf16 GEMM, against x W^T with W rounded
  to bf16.
- Every instruction set's code the build has (quant_linear_isa: AVX-512 VNNI, AVX2, portable)
  passes the checks above, and the vector code agrees with the portable code at every row
  count including ragged row tiles and odd block counts. An AVX-512 VNNI machine runs all three,
  an AVX2 machine two; the others skip, naming what is missing.
- Each choice can be forced: many_rows=0 (always the GEMM), NO_GEMM (never), None (PyTorch's
  kernels); the default follows the CPU (AMX: GEMM above MANY_ROWS_AMX). One op either way,
  so a compiled graph with a dynamic row count compiles once.
- Where the kernel cannot be built (no compiler) or a shape does not fit the layout, the
  layers keep PyTorch's kernels, and the load log says so.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from runtime.models import quant_linear
from runtime.models.cpu_kernels import DISABLE_ENV, ISAS, cpu_kernels_available, has_vector_kernel
from runtime.models.quant_linear import (MANY_ROWS_AMX, NO_GEMM, Int4Linear, Int8Linear, blocked_layout,
                                         linear_kernels)
from runtime.models.quantized_weight import QuantizedWeight, gguf_int4_exact, quantize_int4, quantize_int8

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(not cpu_kernels_available(), reason="the CPU kernel did not build here")
# the layers take the kernel only where it has vector code (AVX2 or better): elsewhere PyTorch's
needs_layers_on_kernel = pytest.mark.skipif(not has_vector_kernel(),
                                            reason="the CPU kernel has no vector code here: layers keep PyTorch's")


def built(isa: str) -> bool:
    return cpu_kernels_available() and torch.ops.heterospec_cpu.isa_built(ISAS.index(isa))


# each instruction set's code, and the op's own choice (None)
PATHS = [pytest.param(isa, marks=pytest.mark.skipif(not built(isa), reason=f"this build has no {isa} code"))
         for isa in ISAS] + [None]


def gguf_weight(type_name: str, n: int, k: int, seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    """A GGUF int4 weight made by gguf's quantize, and gguf's own dequantization of it [n, k]."""
    rows = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = quantize(rows, GGMLQuantizationType[type_name])
    return gguf_int4_exact(raw, type_name, (n, k)), torch.from_numpy(dequantize(raw, GGMLQuantizationType[type_name]))


def weights() -> dict[str, tuple[QuantizedWeight, torch.Tensor]]:
    """208 outputs (13 blocks of 16: uneven across threads), K 256; each with its float weight."""
    torch.manual_seed(0)
    w = torch.randn(208, 256) * 0.05
    group128, int8 = quantize_int4(w, "x", group_size=128), quantize_int8(w, "x")
    return {"Q4_0": gguf_weight("Q4_0", 208, 256), "Q4_1": gguf_weight("Q4_1", 208, 256, seed=1),
            "int4 group 128": (group128, group128.dequantize()), "int8": (int8, int8.dequantize())}


WEIGHTS = weights()


def stored(weight: QuantizedWeight) -> torch.Tensor:
    """The weight [N, K] as the layout stores it: scales and offsets in float16 (GGUF's Q4_0
    and Q4_1 block scales are fp16, so for them this is gguf's weight bit for bit)."""
    return dataclasses.replace(weight, scales=weight.scales.half().float(),
                               offsets=None if weight.offsets is None else weight.offsets.half().float()).dequantize()


def int8_activation_product(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """The few-rows regime's arithmetic in float64: x [M, K] quantized per block of 32 to
    x_q = round(x 127 / max|x|) max|x| / 127, times the weight s q + o."""
    m, k = x.shape
    blocks = x.float().view(m, k // 32, 32)  # the kernel's float32 steps, to round the same ties
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, 0.0)  # (127 / amax: 127 * (1 / amax))
    xq = torch.round(blocks * inverse)  # half to even, as the kernel
    x_hat = (xq.double() * (amax / 127).double()).view(m, k)  # [M, K]
    return x_hat @ stored(weight).double().t()


def run_op(isa: str | None, x: torch.Tensor, weight: QuantizedWeight, many_rows: int) -> torch.Tensor:
    """quant_linear, or with isa, the code of that instruction set (quant_linear_isa)."""
    q, scales, offsets = blocked_layout(weight)
    args = (x, q, scales, offsets, weight.bits, weight.group_size, many_rows, 16 * 256 * 2)  # 16-column tiles
    if isa is None:
        return torch.ops.heterospec_cpu.quant_linear(*args)
    return torch.ops.heterospec_cpu.quant_linear_isa(*args, ISAS.index(isa))


@needs_kernel
@pytest.mark.parametrize("name", list(WEIGHTS))
@pytest.mark.parametrize("rows", [1, 7, 40])
@pytest.mark.parametrize("isa", PATHS)
def test_few_rows_regime_is_int8_activations_on_the_weight(name, rows, isa):
    weight, exact_weight = WEIGHTS[name]
    x = torch.randn(rows, 256, dtype=torch.bfloat16)
    out = run_op(isa, x, weight, NO_GEMM)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 208)
    reference = int8_activation_product(x, weight)
    torch.testing.assert_close(out.double(), reference, atol=1e-3 * reference.abs().max().item(), rtol=8e-3)
    exact = x.double() @ exact_weight.double().t()  # gguf's weight: what the int8 activations cost
    assert (out.double() - exact).norm() / exact.norm() < 0.03


@needs_kernel
@pytest.mark.parametrize("name", list(WEIGHTS))
@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("isa", PATHS)
def test_many_rows_regime_is_a_bf16_gemm_on_the_weight(name, rows, isa):
    weight, exact_weight = WEIGHTS[name]
    x = torch.randn(rows, 256, dtype=torch.bfloat16)
    out = run_op(isa, x, weight, 0)
    reference = x.float() @ stored(weight).bfloat16().float().t()
    torch.testing.assert_close(out.float(), reference, atol=2e-2 * reference.abs().max().item(), rtol=1e-2)


@needs_layers_on_kernel
def test_ggufs_q4_0_and_q4_1_are_stored_exactly():
    for name in ("Q4_0", "Q4_1"):
        weight, gguf_dequantized = WEIGHTS[name]
        assert torch.equal(stored(weight), gguf_dequantized)
        assert Int4Linear(weight, None, torch.bfloat16, CPU).error == 0  # the load log: exact


@needs_kernel
@pytest.mark.parametrize("many_rows", [0, NO_GEMM])
@pytest.mark.parametrize("isa", PATHS[1:3])
def test_vector_and_portable_code_agree(many_rows, isa):
    for weight, _ in WEIGHTS.values():
        for rows in (1, 2, 3, 4, 5, 9):
            x = torch.randn(rows, 256, dtype=torch.bfloat16)
            vector, portable = run_op(isa, x, weight, many_rows), run_op("portable", x, weight, many_rows)
            torch.testing.assert_close(vector.float(), portable.float(), atol=1e-3 * portable.abs().max().item(),
                                       rtol=8e-3)


@needs_kernel
@pytest.mark.parametrize("isa", PATHS[1:3])
@pytest.mark.parametrize("bits", [4, 8])
def test_weights_at_the_ends_of_their_range(isa, bits):
    """AVX2 multiplies bytes into saturating int16 pair sums: the largest weights (int4 0 and
    15; int8 -128 and 127) against activations of +-127 must still sum exactly."""
    k = 256
    low, high = (0, 15) if bits == 4 else (-128, 127)
    q = torch.full((16, k), high, dtype=torch.uint8 if bits == 4 else torch.int8)
    q[::2] = low
    q[1::4, ::3] = low  # mixed rows too
    weight = QuantizedWeight(bits, q, torch.ones(16, 1), None, k, "x")
    x = torch.where(torch.arange(k) % 2 == 0, 1.0, -1.0).repeat(3, 1)  # [3, K]; x_q = +-127
    x[1], x[2] = -x[1], 1.0
    out = run_op(isa, x.bfloat16(), weight, NO_GEMM).double()
    reference = (torch.round(x * 127) / 127).double() @ q.double().t()
    # exact integer sums (a saturated pair would be off by hundreds), then float32 scaling and bf16
    torch.testing.assert_close(out, reference, atol=1e-4 * reference.abs().max().item(), rtol=1 / 128)


def layer(bits: int, many_rows, out_features: int = 96):
    torch.manual_seed(0)
    w = torch.randn(out_features, 256) * 0.05
    bias = torch.randn(out_features) * 0.1
    if bits == 4:
        return Int4Linear(quantize_int4(w, "x"), bias, torch.bfloat16, CPU, many_rows=many_rows)
    return Int8Linear(quantize_int8(w, "x"), bias, torch.bfloat16, CPU, many_rows=many_rows)


@needs_layers_on_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_layers_choose_by_rows_and_each_choice_can_be_forced(bits):
    pytorch, gemm, dots, split = layer(bits, None), layer(bits, 0), layer(bits, NO_GEMM), layer(bits, 24)
    assert "heterospec" not in pytorch.kernel and pytorch.many_rows is None
    assert "bf16 GEMM" in split.kernel and split.many_rows == 24
    assert "bf16 GEMM" not in dots.kernel and "int8 activations" in dots.kernel
    for rows in (1, 24, 25, 64):
        x = torch.randn(rows, 256, dtype=torch.bfloat16)
        reference = pytorch(x).float()  # PyTorch's kernel
        for ours in (gemm, dots, split):
            out = ours(x).float()
            assert (out - reference).norm() / reference.norm() < 0.03
        # the split layer takes exactly one of the two regimes: the dot products up to 24 rows
        assert torch.equal(split(x), (dots if rows <= 24 else gemm)(x))


@needs_layers_on_kernel
def test_the_default_follows_the_cpu(monkeypatch):
    monkeypatch.setattr(quant_linear, "amx_available", lambda: True)
    assert layer(4, "auto").many_rows == MANY_ROWS_AMX
    monkeypatch.setattr(quant_linear, "amx_available", lambda: False)
    assert layer(8, "auto").many_rows == NO_GEMM
    assert layer(8, "auto", out_features=100).many_rows is None  # 16 does not divide N: PyTorch's kernel


@needs_layers_on_kernel
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
    monkeypatch.setattr(quant_linear, "has_vector_kernel", lambda: False)
    int4, int8 = layer(4, "auto"), layer(8, "auto")
    assert int4.many_rows is None and int8.many_rows is None
    assert "heterospec" not in linear_kernels(torch.nn.Sequential(int4, int8))
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    assert int4(x).shape == int8(x).shape == (64, 96)


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None or os.environ.get(DISABLE_ENV) == "0",
                    reason="no C++ compiler here, or the kernels are turned off")
def test_the_kernel_builds_wherever_there_is_a_compiler():
    """A failed build leaves PyTorch's slower kernels and skips this file's other tests, so it
    must not pass unseen: torch 2.14's headers need C++20, and a C++17 build failed there."""
    assert cpu_kernels_available(), "the CPU kernel did not build: see the warning logged above"


def test_a_failed_build_is_a_warning_not_an_error(tmp_path):
    """No compiler: cpu_kernels_available() is False, with the reason logged."""
    code = ("import logging; logging.basicConfig(level=logging.WARNING)\n"
            "from runtime.models.cpu_kernels import cpu_kernels_available\n"
            "print('available', cpu_kernels_available())")
    env = dict(os.environ, CXX="/bin/false", HETEROSPEC_CACHE_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "available False" in run.stdout
    assert "quant_linear" in run.stderr and "unavailable" in run.stderr
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-built left behind
