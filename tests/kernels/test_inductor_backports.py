"""Inductor backports (target_gpu.inductor_backports): applied only where torch lacks them,
and a graph whose kernels recur defines each distinct kernel once and still computes what
eager PyTorch does."""
from __future__ import annotations

import re

import pytest
import torch

from target_gpu.inductor_backports import define_each_cpp_kernel_once, needs_kernel_dedup


@pytest.mark.parametrize("version, needed", [("2.8.0+cu128", True), ("2.8.1", True), ("2.9.0", False),
                                             ("2.14.1+cu130", False)])
def test_the_dedup_is_backported_only_before_torch_2_9(version, needed):
    assert needs_kernel_dedup(version) is needed


def two_layers(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same pointwise kernel twice, on either side of a matmul Inductor leaves to aten
    (h is returned too, so that the second kernel does not overwrite it in place)."""
    h = torch.mm((x * 2).relu() + 1, w)
    return torch.mm((h * 2).relu() + 1, w), h


@pytest.mark.parametrize("cpp_wrapper", [True, False], ids=["cpp-wrapper", "python-wrapper"])
def test_a_recurring_kernel_is_defined_once(cpp_wrapper):
    # imported here: torch._inductor.utils imports triton, which test_triton_attention must
    # import first (under its interpreter) when the suite collects
    from torch._inductor.utils import fresh_cache, run_and_get_code

    define_each_cpp_kernel_once()
    torch._dynamo.reset()
    compiled = torch.compile(two_layers, fullgraph=True,
                             options={"cpp_wrapper": cpp_wrapper, "cpp_wrapper_build_separate": cpp_wrapper})
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    with fresh_cache():  # the code generated now, not a cached one
        out, sources = run_and_get_code(compiled, x, w)
    code = "\n".join(sources)
    # a kernel's definition: its C++ signature followed by its body
    defined = set(re.findall(r"void\s+(?:kernel|cpp_fused_\w+)\([^)]*\)\s*\{", code))
    called = set(re.findall(r"\b(cpp_fused_\w+)\(", code))
    assert len(defined) == 1, code
    assert len(called) == 1, code
    torch.testing.assert_close(out, two_layers(x, w))
