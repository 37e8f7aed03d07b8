"""What this CPU can do, asked once where the code must choose a kernel or a dtype."""
from __future__ import annotations

from pathlib import Path

import torch


def amx_available() -> bool:
    try:
        return bool(torch._C._cpu._is_amx_tile_supported())
    except AttributeError:
        return False


def cpu_has_bf16_math() -> bool:
    """Whether this CPU multiplies bf16 natively (AMX or AVX-512 BF16). Without either,
    oneDNN converts bf16 to fp32 on the fly, slower than fp32 itself."""
    if amx_available():
        return True
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and "avx512_bf16" in line.split() for line in cpuinfo.splitlines())
