"""CPU backends for the draft model: IPEX when importable, plain PyTorch always.

Both run the same DecoderModel (runtime.models.decoder); a backend only swaps modules:
  - `torch`: bf16 linear layers are prepacked once into oneDNN's blocked layout
    (runtime.models.packed_linear: PyTorch's own oneDNN ops, as Inductor uses them; a
    plain bf16 nn.Linear reorders its weight on every call). With `int8`, every linear
    layer (and the LM head) becomes Int8Linear: per-output-channel symmetric int8 weights
    through runtime.models.quant_linear's kernels (this project's heterospec_cpu.quant_linear
    on a bf16 model, else `torch.ops.aten._weight_int8pack_mm`). On the CPU each layer
    shape is timed once at load against the float layer (`int8_row_limit`, with cold
    caches, as in a decode step); where int8 loses past some row count, calls with more rows
    run through the float layer, which is then kept (int8 then buys small-batch speed, not
    memory). With `int4` (or `auto` on a quantized file) the weights come quantized from the
    load (runtime.models.loader): Int4Linear, group-wise int4, the same kernels.
  - `ipex` (intel-extension-for-pytorch): `ipex.optimize` prepacks the linear weights
    into oneDNN's blocked layout, RMSNorm runs IPEX's fused kernel, and `int8` uses IPEX's
    weight-only quantized linear (bf16 compute on AMX).
IPEX is archived upstream and pins torch 2.8.x and transformers < 5, so `auto` takes it
only when it imports cleanly.
"""
from __future__ import annotations

import functools
import logging
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from runtime.platform import amx_available
from runtime.models.decoder import RMSNorm
from runtime.models.packed_linear import PackedLinear, can_prepack, linear_children, prepack_linears
from runtime.models.quant_linear import Int4Linear, Int8Linear, linear_kernels
from runtime.models.quantized_weight import quantize_int4, quantize_int8

log = logging.getLogger("draft_cpu.backends")

BACKENDS = ("auto", "ipex", "torch")
QUANTIZATIONS = ("auto", "none", "int8", "int4")


def import_ipex():
    """The intel_extension_for_pytorch module, or None when it does not import here."""
    try:
        import intel_extension_for_pytorch as ipex  # noqa: F401
    except Exception as exc:  # ImportError, or a version mismatch raised at import
        log.debug("intel_extension_for_pytorch unavailable: %s", exc)
        return None
    return ipex


def resolve_backend(name: str, device: torch.device) -> str:
    if name not in BACKENDS:
        raise ValueError(f"draft backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if device.type != "cpu":
        if name == "ipex":
            raise ValueError("the ipex draft backend runs on the CPU only; use --draft-device cpu")
        return "torch"
    if name == "auto":
        return "ipex" if import_ipex() is not None else "torch"
    if name == "ipex" and import_ipex() is None:
        raise ValueError("--draft-backend ipex: intel_extension_for_pytorch does not import here "
                         "(it needs torch 2.8.x and transformers < 5); use --draft-backend torch")
    return name


def int8_linear(linear: nn.Linear, max_int8_rows: int | None = None) -> Int8Linear:
    """`linear` as per-row int8 (quant_linear.Int8Linear); with max_int8_rows set, inputs of
    more rows run through the float layer that would run it without int8 (float_layer)."""
    weight = linear.weight.detach()
    return Int8Linear(quantize_int8(weight, f"{str(weight.dtype)[6:]} quantized"),
                      None if linear.bias is None else linear.bias.detach().clone(), weight.dtype, weight.device,
                      None if max_int8_rows is None else float_layer(linear), max_int8_rows)


def float_layer(linear: nn.Linear) -> nn.Module:
    """The float layer a model runs `linear` as without int8: prepacked for oneDNN where it
    can be (bf16 on the CPU), else the layer itself (its weight then shared)."""
    if can_prepack(linear.weight.dtype, linear.weight.device):
        return PackedLinear(linear)
    return linear


ROW_LADDER = (1, 2, 4, 8, 16, 32, 64)  # row counts at which int8 is timed against float


@functools.cache
def last_level_cache_bytes() -> int:
    """This CPU's last-level cache size (sysfs), 32 MiB where it cannot be read."""
    caches = sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"))
    sizes = []
    for size_file in caches:
        text = size_file.read_text().strip()
        if text[:-1].isdigit() and text[-1] in "KM":
            sizes.append(int(text[:-1]) << (10 if text[-1] == "K" else 20))
    return max(sizes, default=32 << 20)


def median_ms(fn: Callable[[], object], repeats: int = 7, warmup: int = 2, cold: bool = False) -> float:
    """Median wall time of fn in ms. cold: every timed call starts with the caches holding
    other data (a buffer twice the last-level cache read first), as a layer's weights are in
    a decode step that reads the whole model."""
    evict = torch.ones(2 * last_level_cache_bytes() // 4) if cold else None  # float32 elements
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if evict is not None:
            evict.sum()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def cold_median_ms(fn: Callable[[], object]) -> float:
    return median_ms(fn, repeats=5, warmup=1, cold=True)


@torch.inference_mode()
def int8_row_limit(linear: nn.Linear, timer: Callable[[Callable[[], object]], float] = cold_median_ms) -> int | None:
    """The most rows (of ROW_LADDER) up to which Int8Linear beats the float layer that would
    run `linear` (float_layer: prepacked where it can be), counting up until int8 first
    loses; None when it wins at every count (no float copy needed)."""
    int8, float_path = int8_linear(linear), float_layer(linear)
    weight = linear.weight
    limit = 0
    for rows in ROW_LADDER:
        x = torch.randn(rows, linear.in_features, dtype=weight.dtype, device=weight.device)  # [M, K]
        if timer(lambda: int8(x)) >= timer(lambda: float_path(x)):
            return limit
        limit = rows
    return None


def quantize_int8_torch(model: nn.Module, timer=cold_median_ms) -> dict[tuple[int, int], int | None]:
    """Swap every nn.Linear for Int8Linear (the tied embedding keeps its float table). On the
    CPU each distinct (in, out) shape is timed once (int8_row_limit) and its layers run int8
    only up to that many rows. Returns {(in, out): row limit} (None: int8 at any rows)."""
    limits: dict[tuple[int, int], int | None] = {}
    for parent, name, linear in list(linear_children(model)):
        shape = (linear.in_features, linear.out_features)
        if shape not in limits:
            limits[shape] = int8_row_limit(linear, timer) if linear.weight.device.type == "cpu" else None
        setattr(parent, name, int8_linear(linear, limits[shape]))
    return limits


def describe_row_limits(limits: dict[tuple[int, int], int | None]) -> str:
    """e.g. "int8 up to 2 rows at 576x8192, up to 4 rows at 576x1536, float beyond"."""
    parts = [f"{'at any rows' if limit is None else f'up to {limit} rows'} at {k}x{n}"
             for (k, n), limit in sorted(limits.items())]
    return f"int8 {', '.join(parts)}, float beyond"


def ipex_can_prepack(ipex, dtype: torch.dtype) -> bool:
    """Whether ipex.optimize may prepack weights of this dtype here: bf16 and fp16 prepacking
    needs AVX-512 (or AVX-NE-CONVERT), and IPEX asserts without it (an AVX2 EPYC)."""
    if dtype == torch.bfloat16:
        return bool(ipex._C.onednn_has_bf16_support())
    if dtype == torch.float16:
        return bool(ipex._C.onednn_has_fp16_support())
    return True


def quantize_int8_ipex(model: nn.Module, ipex) -> int:
    from intel_extension_for_pytorch.nn.modules.weight_only_quantization import WeightOnlyQuantizedLinear
    from intel_extension_for_pytorch.quantization import WoqLowpMode, get_weight_only_quant_qconfig_mapping
    lowp = WoqLowpMode.BF16 if model.dtype == torch.bfloat16 else WoqLowpMode.NONE
    qconfig = get_weight_only_quant_qconfig_mapping(lowp_mode=lowp).global_qconfig
    swapped = 0
    embed = getattr(model, "embed_tokens", None)
    for parent, name, linear in list(linear_children(model)):
        if embed is not None and parent is model and name == "lm_head" and linear.weight is embed.weight:
            linear = nn.Linear(linear.in_features, linear.out_features, bias=False, dtype=model.dtype)
            linear.weight = nn.Parameter(model.embed_tokens.weight.detach().clone(), requires_grad=False)
        linear.qconfig = qconfig
        setattr(parent, name, WeightOnlyQuantizedLinear.from_float(linear))
        swapped += 1
    return swapped


class IpexRMSNorm(nn.Module):
    """RMSNorm through IPEX's fused kernel (same weight)."""

    def __init__(self, norm: RMSNorm, ipex):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        self._rms_norm = ipex.llm.functional.rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._rms_norm(x, self.weight, self.eps)


def load_quantization(quantization: str) -> str:
    """What runtime.models.loader.load_model is asked for when the draft runs `quantization`:
    int8 is applied by the backend (prepare_model) to a float model; auto, int4 and none at load."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"draft quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    return "none" if quantization == "int8" else quantization


def quantize_int4_layers(model: nn.Module) -> int:
    """Swap every float linear layer left in model (nn.Linear, or PackedLinear keeping its
    weight) for an Int4Linear (group-wise int4 made here); returns how many."""
    layers = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
              if isinstance(child, nn.Linear) or (isinstance(child, PackedLinear) and child.weight is not None)]
    for parent, name, child in layers:
        weight = child.weight.detach()
        setattr(parent, name, Int4Linear(quantize_int4(weight, f"{str(weight.dtype)[6:]} quantized"),
                                         None if child.bias is None else child.bias.detach(), weight.dtype,
                                         weight.device))
    return len(layers)


def prepare_model(model: nn.Module, backend: str, quantization: str) -> str:
    """Apply `backend` ("ipex" | "torch", resolved) and `quantization` in place to model (a
    DecoderModel, or a speculation head: any module with a `dtype`; only its own submodules
    change); returns a one-line description for the start-up log. Layers the load already
    quantized (load_quantization) are left as they are; with int4, float layers still left
    (a speculation head's) are quantized here."""
    load_quantization(quantization)
    device = next(model.parameters()).device
    parts = [f"backend {backend}", str(model.dtype).replace("torch.", "")]
    if quantization == "int4":
        quantize_int4_layers(model)
    if backend == "ipex":
        ipex = import_ipex()
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, RMSNorm):
                    setattr(parent, name, IpexRMSNorm(child, ipex))
        parts.append("fused RMSNorm")
        if quantization == "int8":
            parts.append(f"int8 weight-only (IPEX WOQ, {quantize_int8_ipex(model, ipex)} linear layers)")
        else:
            prepack = ipex_can_prepack(ipex, model.dtype)
            ipex.optimize(model, dtype=model.dtype, inplace=True, weights_prepack=prepack)
            parts.append("prepacked linear weights" if prepack else
                         f"linear weights not prepacked (oneDNN has no {str(model.dtype)[6:]} kernels on this CPU)")
    elif quantization == "int8":
        parts.append(f"int8 weight-only (torch, {describe_row_limits(quantize_int8_torch(model))})")
    elif packed := prepack_linears(model):
        parts.append(f"{packed} linear layers prepacked for oneDNN")
    if quantization in ("auto", "int4"):
        parts.append(f"linear layers: {linear_kernels(model)}")
    if device.type == "cpu":
        parts.append(f"AMX {'yes' if amx_available() else 'no'}")
    return ", ".join(parts)
