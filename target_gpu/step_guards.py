"""What the compiled decode step checks on each call before it runs a graph.

Dynamo guards a compiled function on everything its trace read: for a decoder, each of the
model's ~500 tensors (dtype, shape, strides, dispatch keys, no aliasing), every module's type
and hook dicts, every int and float the forward read: about 3,500 checks a call on the
default model. On torch >= 2.13 they took 1 ms of a 5 ms single-stream step.

The model is fixed once an engine has built it, so the step checks a key instead:
`structure_key(model)`, computed once per engine, is a digest of everything about the model
that a graph could depend on except its tensors' values. The step takes it as an argument
(a string, which Dynamo guards by value), and `drop_model_guards` drops Dynamo's guards on
the model itself. Two engines whose models share a key share graphs (a target and its
self-draft, the test suite's engines); a model that differs in anything the key covers gets
graphs of its own. Guards on the step's other arguments (token tensors, caches, feature
layers) and on globals stay as Dynamo made them.

The key errs on the safe side: it covers every attribute reachable from the model (a
differing value only costs a compile), not just the ones the forward reads. It assumes
nothing about the model changes after the engine is built but its tensors' values; code
that swaps a module, a class's method or a tensor's shape must build a new engine.
"""
from __future__ import annotations

import enum
import hashlib
import types

import torch

_SCALARS = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device, torch.layout,
            torch.memory_format, enum.Enum)
_CODE = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType, types.CodeType)


def tensor_description(t: torch.Tensor) -> str:
    """What Dynamo's TENSOR_MATCH guard checks of a tensor, and more."""
    try:
        layout = f"{tuple(t.stride())}+{t.storage_offset()}"
    except (RuntimeError, NotImplementedError):  # opaque tensors (oneDNN-packed weights) have no strides
        layout = "opaque"
    return (f"{type(t).__qualname__}({t.dtype},{t.device},{t.layout},{tuple(t.shape)},{layout},"
            f"grad={t.requires_grad},{torch._C._dispatch_keys(t)})")


def structure_key(model: torch.nn.Module) -> str:
    """A digest of every object reachable from `model` through attributes, lists, tuples and
    dicts: each one's type, each scalar's value, each tensor's description, and which
    objects are the same object (tied weights, a config every layer holds)."""
    first_seen: dict[int, int] = {}  # id -> visit number: an object met again is written as its number
    lines: list[str] = []

    def visit(obj, path: str) -> None:
        if isinstance(obj, _SCALARS):
            lines.append(f"{path}={obj!r}")
            return
        if isinstance(obj, _CODE):  # by identity: two classes or functions may share a name
            lines.append(f"{path}=<{getattr(obj, '__qualname__', type(obj).__name__)} {id(obj):x}>")
            return
        if id(obj) in first_seen:
            lines.append(f"{path}=#{first_seen[id(obj)]}")
            return
        first_seen[id(obj)] = len(first_seen)
        kind = type(obj)
        lines.append(f"{path}:<{kind.__qualname__} {id(kind):x}>")
        if isinstance(obj, torch.Tensor):
            lines.append(tensor_description(obj))
            if hasattr(obj, "__tensor_flatten__"):  # a tensor subclass (torchao's): its metadata and inner tensors
                inner, metadata = obj.__tensor_flatten__()
                lines.append(repr(metadata))
                for name in inner:
                    visit(getattr(obj, name), f"{path}.{name}")
        elif isinstance(obj, (list, tuple)):
            for i, item in enumerate(obj):
                visit(item, f"{path}[{i}]")
        elif isinstance(obj, dict):
            for k, v in obj.items():
                visit(v, f"{path}[{k!r}]")
        elif isinstance(obj, (set, frozenset)):
            lines.append(repr(sorted(map(repr, obj))))
        else:
            attributes = dict(getattr(obj, "__dict__", {}))
            for klass in kind.__mro__:
                slots = getattr(klass, "__slots__", ())
                attributes.update((name, getattr(obj, name)) for name in ((slots,) if isinstance(slots, str) else slots)
                                  if hasattr(obj, name))
            if not attributes:  # opaque (a C++ handle, such as a process group): by identity
                lines.append(f"{path}=<{id(obj):x}>")
            for name, value in attributes.items():
                visit(value, f"{path}.{name}")

    visit(model, "model")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def is_model_guard(name: str) -> bool:
    """A guard on the model argument or anything reached through it."""
    return name == "model" or name.startswith(("model.", "model["))


def drop_model_guards(entries) -> list[bool]:
    """torch.compile's guard_filter_fn: keep every guard but those on the model (its key is
    guarded instead)."""
    return [not is_model_guard(entry.name) for entry in entries]
