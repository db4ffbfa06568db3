"""What one first compilation is specialised to, and how a call differs from it.

A first compilation records one graph for one set of facts the trace baked in: every
submodule's ``training`` flag (dropout and batch norm take different paths), the structure of
``(args, kwargs)``, every input tensor's shape, strides, dtype, device and ``requires_grad``
(and a tensor subclass's type and flatten context: a DTensor's placements), and every
non-tensor argument's value. :class:`CallSignature` is those facts, hashable, so a
:class:`~ap_backend.PrecompiledModule` keeps one first compilation per signature and can say
exactly which argument made a call different.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ap_epchunk
import torch
from torch import nn

from ap_backend import _compat

__all__ = ["CallSignature", "call_signature", "refuse_dynamic_dims", "subclass_key"]


def _hashable(value: object) -> object:
    try:
        hash(value)
    except TypeError:
        return ("repr", repr(value))
    return value


def subclass_key(t: torch.Tensor) -> tuple[Any, ...]:
    """What a trace of tensor subclass ``t`` bakes in beyond its shape, strides and dtype: its
    type, its ``__tensor_flatten__`` context (a DTensor's placements and global metadata) and
    each inner attribute (a local tensor's metadata, recursively; an opaque object such as the
    device mesh, by value); ``()`` for a plain tensor.

    Why: AOTAutograd rebuilds a subclass's outputs and gradients from the metadata it traced
    with -- a DTensor gradient's placements live in the first compilation's runtime wrappers,
    not in its graphs --, so a first compilation is specialised to it, as Dynamo's guards on
    the same context are."""
    # the traceable wrapper subclass protocol (what torch's is_traceable_wrapper_subclass checks)
    kind = type(t)
    if kind is torch.Tensor or not (
        hasattr(t, "__tensor_flatten__") and hasattr(t, "__tensor_unflatten__")
    ):
        return ()
    attrs, ctx = t.__tensor_flatten__()
    inner: list[tuple[str, object]] = []
    for name in attrs:
        value = getattr(t, name)
        if isinstance(value, torch.Tensor):
            inner.append((name, _tensor_key(value)))
        else:
            inner.append((name, _hashable(value)))
    return (f"{kind.__module__}.{kind.__qualname__}", _hashable(ctx), tuple(inner))


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (
        "tensor",
        tuple(int(s) for s in t.shape),
        tuple(int(s) for s in t.stride()) if t.layout == torch.strided else (),
        str(t.dtype),
        str(t.device),
        bool(t.requires_grad),
        subclass_key(t),
    )


def _leaf_key(leaf: object) -> tuple[Any, ...]:
    if isinstance(leaf, torch.Tensor):
        return _tensor_key(leaf)
    try:
        hash(leaf)
    except TypeError:
        return ("object", type(leaf).__qualname__, id(leaf))
    return ("value", type(leaf).__qualname__, leaf)


def _describe_context(ctx: object) -> str:
    """A subclass's ``__tensor_flatten__`` context as a message shows it, the same on every
    torch: a DTensor spec in it reads as its placements and tensor metadata.

    Why: torch 2.11 flattens a DTensor's context as ``(DTensorSpec, requires_grad)`` -- the
    spec's repr leads with the device mesh and buries the placements, which are what a
    mismatch message is about -- where torch 2.15 flattens ``(placements, tensor_meta,
    shard_order, requires_grad)``. The key itself keeps the context as flattened."""
    if not isinstance(ctx, tuple):
        return repr(ctx)
    parts: list[str] = []
    for item in ctx:
        placements = getattr(item, "placements", None)
        if isinstance(placements, tuple) and hasattr(item, "tensor_meta"):
            parts += [repr(placements), repr(item.tensor_meta)]
        else:
            parts.append(repr(item))
    return f"({', '.join(parts)}{',' if len(parts) == 1 else ''})"


def _describe_leaf(key: tuple[Any, ...]) -> str:
    if key[0] == "tensor":
        _, shape, stride, dtype, device, requires_grad, subclass = key
        grad = ", requires_grad" if requires_grad else ""
        # a subclass's type and context (a DTensor's placements), when it has them
        kind = (
            f"{subclass[0].rsplit('.', 1)[-1]} {_describe_context(subclass[1])} "
            if subclass
            else "tensor "
        )
        return f"{kind}{tuple(shape)} {dtype.replace('torch.', '')} on {device}{grad} (strides {stride})"
    if key[0] == "value":
        return f"{key[1]} {key[2]!r}"
    return f"{key[1]} object id {key[2]:#x}"


def _pretty_path(keystr: str, arg_names: Sequence[str]) -> str:
    """``[0][1]`` -> ``y (args[1])``, ``[1]['labels']`` -> ``labels (kwargs['labels'])``."""
    if keystr.startswith("[0]["):
        rest = keystr[3:]
        index_end = rest.index("]")
        index = int(rest[1:index_end])
        tail = rest[index_end + 1 :]
        name = arg_names[index] if index < len(arg_names) else None
        path = f"args[{index}]{tail}"
        return f"{name}{tail} ({path})" if name else path
    if keystr.startswith("[1]["):
        rest = keystr[3:]
        key_end = rest.index("]")
        key = rest[1:key_end]
        tail = rest[key_end + 1 :]
        return f"{key.strip(chr(39))}{tail} (kwargs[{key}]{tail})"
    return keystr


def _positional_names(module: nn.Module) -> list[str]:
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds]


@dataclass(frozen=True)
class CallSignature:
    """``modes``: every submodule's ``training`` flag (``module.modules()`` order); ``spec``:
    the pytree structure of ``(args, kwargs)``; ``leaves``: one key per leaf (tensor
    metadata, or a non-tensor's value). ``paths`` names each leaf for messages."""

    modes: tuple[bool, ...]
    spec: Any
    leaves: tuple[tuple[Any, ...], ...]
    paths: tuple[str, ...] = field(compare=False, hash=False)
    module_names: tuple[str, ...] = field(compare=False, hash=False)

    @property
    def training(self) -> bool:
        """The root module's mode."""
        return self.modes[0] if self.modes else True

    def describe(self) -> str:
        """One line: the mode and every argument."""
        mode = "train" if self.training else "eval"
        args = ", ".join(
            f"{p}: {_describe_leaf(k)}" for p, k in zip(self.paths, self.leaves, strict=True)
        )
        return f"{mode} mode; {args or 'no arguments'}"

    def difference(self, other: CallSignature) -> str:
        """What ``other`` (a call) changes relative to ``self`` (a compiled signature)."""
        if self.modes != other.modes:
            changed = [
                f"{name or '<root>'} {'train' if old else 'eval'} -> {'train' if new else 'eval'}"
                for name, old, new in zip(self.module_names, self.modes, other.modes, strict=True)
                if old != new
            ]
            shown = ", ".join(changed[:4]) + (
                f" (+{len(changed) - 4} more)" if len(changed) > 4 else ""
            )
            return f"module mode changed: {shown}"
        if self.spec != other.spec:
            return (
                f"the arguments' structure changed: compiled for {list(self.paths)}, "
                f"called with {list(other.paths)}"
            )
        for path, old, new in zip(other.paths, self.leaves, other.leaves, strict=True):
            if old != new:
                return f"argument {path}: compiled for {_describe_leaf(old)}, got {_describe_leaf(new)}"
        return "no difference"


def call_signature(
    module: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> CallSignature:
    """The signature of calling ``module(*args, **kwargs)`` in its current mode."""
    named = list(module.named_modules(remove_duplicate=False))
    pairs, spec = _compat.tree_leaves_with_path((tuple(args), dict(kwargs)))
    names = _positional_names(module)
    return CallSignature(
        modes=tuple(m.training for _, m in named),
        spec=spec,
        leaves=tuple(_leaf_key(leaf) for _, leaf in pairs),
        paths=tuple(_pretty_path(path, names) for path, _ in pairs),
        module_names=tuple(n for n, _ in named),
    )


def refuse_dynamic_dims(
    module: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any], *, where: str, limit: int
) -> None:
    """Raise ``ValueError`` naming the first input tensor with dims marked to stay symbolic
    (``torch._dynamo.mark_dynamic`` / ``mark_unbacked``): a first compilation is static, and
    Dynamo would refuse to specialise a marked dim (``ConstraintViolationError``).

    The one exception is a chunk dim marked with ``ap_epchunk.mark_chunk_dim(t, d, hint=N)``
    (itself a ``mark_unbacked``): the first compilation traces it as a hinted unbacked symbol
    (``ap_epchunk.fake_chunk_inputs``) for the backend's ``ep_chunk`` to split and then
    concretize; any other marked dim on that tensor is still refused."""
    pairs, _ = _compat.tree_leaves_with_path((tuple(args), dict(kwargs)))
    names = _positional_names(module)
    for path, leaf in pairs:
        if not isinstance(leaf, torch.Tensor):
            continue
        marks = _compat.dynamic_dim_marks(leaf)
        hinted = {d for d, h in ap_epchunk.chunk_dims_of(leaf).items() if h is not None}
        if marks and {d for dims in marks.values() for d in dims} - hinted:
            api, dims = next(iter(marks.items()))
            path_name = _pretty_path(path, names)
            raise ValueError(
                f"{where}: {path_name} has dim(s) {list(dims)} marked dynamic "
                f"({api}), but a first compilation records static shapes. Remove the mark: a "
                f"call with a new shape gets its own first compilation (up to "
                f"max_signatures={limit}), or pad inputs to one shape."
            )
