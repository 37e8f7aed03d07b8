"""Fixes from newer Inductor releases that the compiled decode step needs on older torch.

Each one is applied once, only on the torch versions that lack it, and says which upstream
change it backports. Nothing here changes what a graph computes.

- One definition per distinct CPU kernel (pytorch/pytorch#158404, in torch 2.9). A decoder's
  layers lower to the same few fused C++ kernels, layer after layer. torch 2.8 named and
  defined each occurrence anew, so g++ built every layer's copies at -O3. Newer torch
  defines a kernel once per distinct source and calls it by that name wherever it recurs.
"""
from __future__ import annotations

import functools
import threading

import torch
from torch.torch_version import TorchVersion

_lock = threading.Lock()  # engines build their steps on several threads (the draft worker's, the server's)
_kernel_dedup_applied = False


def needs_kernel_dedup(version: str = torch.__version__) -> bool:
    """torch before 2.9 defines a CPU kernel at each place its source recurs."""
    return TorchVersion(version) < (2, 9)


def define_each_cpp_kernel_once() -> None:
    """Make CppScheduling.define_kernel reuse the name of a kernel whose source the graph's
    wrapper has already defined, as torch >= 2.9 does (no-op there)."""
    global _kernel_dedup_applied
    with _lock:
        if needs_kernel_dedup() and not _kernel_dedup_applied:
            _patch_define_kernel()
            _kernel_dedup_applied = True


def _patch_define_kernel() -> None:
    from torch._inductor.codegen.cpp import CppScheduling
    from torch._inductor.virtualized import V

    original = CppScheduling.define_kernel

    @functools.wraps(original)
    def define_kernel(self, src_code, nodes, kernel_args=None):
        defined = V.graph.wrapper_code.src_to_kernel  # source -> kernel name, per graph
        if src_code not in defined:  # the source still holds its name placeholder, so equal sources are equal kernels
            defined[src_code] = original(self, src_code, nodes, kernel_args)
        return defined[src_code]

    CppScheduling.define_kernel = define_kernel
