"""This project's own CPU kernels (runtime/models/kernels/*.cpp), built on first use.

They are compiled for this machine's CPU (-march=native, as llama.cpp's GGML_NATIVE) with
the C++ compiler that torch.compile's CPU backend already needs, into
~/.cache/heterospec/kernels (HETEROSPEC_CACHE_DIR overrides ~/.cache/heterospec), keyed by
the source, the torch build and the CPU's flags, and loaded as torch ops. Where the build
fails (no compiler), `cpu_kernels_available()` is False and callers keep PyTorch's kernels;
the load log says which kernel each layer got.

heterospec_cpu::quant_linear(x bf16 [M, K], q, scales, offsets, bits, group, many_rows,
tile_bytes) -> bf16 [M, N]: y = x W^T for an int4/int8 weight-only quantized W in the blocked
layout (kernels/quant_linear.cpp): integer dot products on the packed bytes up to many_rows
rows, tiles of W dequantized into a bf16 GEMM above (one op: a compiled graph holds no branch
on the row count). Its vector code is AVX-512 VNNI's or AVX2's, whichever the build has
(`kernel_isa()` names it); quant_linear_isa(..., isa) runs the code of one instruction set of
ISAS that the build has (isa_built(isa)), for tests.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "kernels" / "quant_linear.cpp"
ISAS = ("portable", "AVX2", "AVX-512 VNNI")  # kernels/quant_linear.cpp's Isa, in its order
DISABLE_ENV = "HETEROSPEC_CPU_KERNELS"  # "0": never build or load them (PyTorch's kernels only)


def _cache_dir() -> Path:
    root = os.environ.get("HETEROSPEC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "heterospec")
    return Path(root) / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def _compile_command(output: str) -> list[str]:
    # torch.utils.cpp_extension's include_paths() say the same, but importing it warns
    # about CUDA_HOME on a CUDA build of torch without a GPU
    root = Path(torch.__file__).parent
    includes = [f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}"]
    lib = root / "lib"
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [os.environ.get("CXX", "g++"), "-O3", "-march=native", _cpp_standard(), "-fPIC", "-shared", "-fopenmp", abi,
            *includes, str(SOURCE), "-o", output, f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu", "-ltorch"]


def _cpp_standard() -> str:
    """The C++ standard torch's own extension builds use: C++20 from torch 2.13 (its headers
    need it from 2.14), C++17 before."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return "-std=c++20" if (major, minor) >= (2, 13) else "-std=c++17"


def _build() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + _cpu_flags().encode()
                         + " ".join(_compile_command("")).encode() + sys.version.encode()).hexdigest()[:16]
    library = _cache_dir() / f"quant_linear-{key}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    log.info("building the CPU kernel heterospec_cpu.quant_linear for this CPU (once; cached in %s)", library.parent)
    with tempfile.NamedTemporaryFile(dir=library.parent, suffix=".so", delete=False) as tmp:
        partial = tmp.name
    try:
        run = subprocess.run(_compile_command(partial), capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(run.stderr.strip().splitlines()[-1] if run.stderr.strip() else f"exit {run.returncode}")
        os.replace(partial, library)  # atomic: another process may build the same file meanwhile
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return library


@functools.cache
def cpu_kernels_available() -> bool:
    """Build (once per machine) and load heterospec_cpu's ops; False where they cannot be."""
    if os.environ.get(DISABLE_ENV) == "0":
        return False
    try:
        torch.ops.load_library(str(_build()))
    except Exception as e:  # noqa: BLE001 - no compiler, or a failed build: PyTorch's kernels stay
        log.warning("the CPU kernel heterospec_cpu.quant_linear is unavailable (%s): quantized layers use PyTorch's "
                    "weight-only kernels at every row count", e)
        return False
    torch.library.register_fake("heterospec_cpu::quant_linear")(_rows_by_outputs)
    torch.library.register_fake("heterospec_cpu::quant_linear_isa")(_rows_by_outputs)
    return True


def kernel_isa() -> str:
    """The instruction set quant_linear's code uses here (one of ISAS; needs the kernel)."""
    return ISAS[torch.ops.heterospec_cpu.best_isa()]


def has_vector_kernel() -> bool:
    """Whether quant_linear is here with vector code (AVX2 or better): where the layers take it.
    Its portable code is the tests' reference, slower than PyTorch's own kernels."""
    return cpu_kernels_available() and kernel_isa() != "portable"


def _rows_by_outputs(x, q, scales, *args):
    return x.new_empty(x.shape[0], scales.shape[0] * scales.shape[2])  # [M, N]
