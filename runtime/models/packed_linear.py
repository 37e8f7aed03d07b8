"""Linear layers whose weights are prepacked once into oneDNN's blocked layout (CPU, bf16).

A plain `F.linear` on the CPU hands oneDNN a row-major weight, which it reorders into its
own blocked layout on every call. When the weight is in cache that costs little, but in a
decode step every weight comes from memory, and the reorder doubles the traffic; prepacked
once, a decode step reads each weight once. This is what IPEX's `ipex.optimize` prepacking does; here it is done with PyTorch's own oneDNN ops
(`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`, the ones Inductor's
freezing pass emits), so the native path has it without IPEX.

Only bf16 is packed, and only on CPUs with bf16 math (AMX or AVX-512 BF16): float32 goes
through MKL, whose prepacked form is tied to one batch size, and without bf16 math oneDNN
emulates it. The result equals `F.linear` up to bf16 rounding (another summation order).

The dtype rule: a linear layer returns its input's dtype and computes in its weight's.
`PackedLinear` keeps it itself: an input of another float dtype is cast to the weight's
dtype on the way in and the output cast back (oneDNN's packed op wants one dtype; given a
float32 input and a bf16 packed weight it fails to create its primitive), so a
PackedLinear stands wherever an nn.Linear of the input's dtype stood. A plain nn.Linear
does not (F.linear wants one dtype), so code calling a layer it does not own, whose
dtype and packing the target's load chose (a head sharing the target's LM head: packed
bf16 where `can_prepack`, row-major otherwise), calls it through `apply_linear`, which
keeps the rule for any kind of layer. Where the dtypes match both are no-ops.

Gradients: oneDNN's packed op has no backward (autograd would pass none through it, with
only a warning), so an input that requires grad (a head trained through the target's LM
head) goes through the kept row-major weight with F.linear instead, and a layer that kept
none refuses. Inference (no grad) always takes the packed op.
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.platform import cpu_has_bf16_math


def _packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                   out_features: int) -> torch.Tensor:
    """x [M, K] @ W^T + b -> [M, N], W prepacked."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


# An op of its own, so that torch.compile calls it as it is: Inductor's lowering of
# `_linear_pointwise` wants the weight as a graph constant (its freezing pass), and the
# compiled decode step passes weights in. Defined with torch.library.Library, not custom_op,
# whose aliasing check reads the storage of its inputs, which an opaque tensor does not have.
_LIBRARY = torch.library.Library("heterospec", "DEF")
_LIBRARY.define("packed_linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features) -> Tensor")
_LIBRARY.impl("packed_linear", _packed_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("heterospec::packed_linear")
def _(x, packed_weight, bias, out_features):
    return x.new_empty(x.shape[0], out_features)


def can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether linear weights of `dtype` on `device` can be prepacked here."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and cpu_has_bf16_math())


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout (an opaque tensor: not in
    state_dict). With keep_weight the row-major `weight` stays too (for code that reads it,
    e.g. a head sharing the target's LM head; free when it is tied to the embedding)."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()  # [N, K]
        self.weight_dtype = weight.dtype  # what it computes in (the packed tensor is opaque)
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.weight = linear.weight if keep_weight else None  # the same Parameter (tied: the embedding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., K] of any float dtype -> [..., N] in x's dtype, computed in the weight's (the dtype rule)
        shape, dtype = x.shape, x.dtype
        if x.requires_grad and torch.is_grad_enabled():  # training through it: the packed op has no backward
            if self.weight is None:
                raise RuntimeError("a PackedLinear without its row-major weight cannot backpropagate "
                                   "(keep_weight=True keeps it)")
            return nn.functional.linear(x.to(self.weight_dtype), self.weight, self.bias).to(dtype)
        y = torch.ops.heterospec.packed_linear(x.reshape(-1, shape[-1]).to(self.weight_dtype), self.packed_weight,
                                               self.bias, self.out_features)  # [M, N]
        return y.reshape(*shape[:-1], self.out_features).to(dtype)

    def unpacked(self) -> nn.Linear:
        """An nn.Linear over the kept weight (and bias), sharing them."""
        if self.weight is None:
            raise ValueError("this PackedLinear did not keep its row-major weight")
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device="meta", dtype=self.weight.dtype)
        linear.weight, linear.bias = self.weight, self.bias
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def apply_linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """layer(x) under the dtype rule (module docstring) for any linear layer: a PackedLinear
    keeps it itself; an nn.Linear gets x in its weight's dtype and gives the output back in
    x's; other layers (quantized ones cast x themselves) are called as they are."""
    if isinstance(layer, nn.Linear) and x.dtype != layer.weight.dtype:
        return layer(x.to(layer.weight.dtype)).to(x.dtype)
    return layer(x)


def linear_children(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent module, attribute name, nn.Linear) for every linear layer, LM head included."""
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if isinstance(child, nn.Linear)]


def prepack_linears(model: nn.Module, keep_weight: tuple[str, ...] = ("lm_head",)) -> int:
    """Replace, in place, every nn.Linear among model's submodules by a PackedLinear (those
    named in keep_weight keep their row-major weight too), where its device and dtype can be
    packed. Returns how many were packed."""
    linears = [(parent, name, child) for parent, name, child in linear_children(model)
               if can_prepack(child.weight.dtype, child.weight.device)]
    for parent, name, child in linears:
        setattr(parent, name, PackedLinear(child, keep_weight=name in keep_weight))
    return len(linears)
