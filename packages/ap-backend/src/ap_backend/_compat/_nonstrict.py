"""What AOTAutograd's cache keying reads in a graph: Dynamo's ``nonstrict_trace`` call sites and
their leaf callables, fake script objects, operator types.

Part of the compat seam (:mod:`ap_backend._compat`): every private torch name is looked up
at call time through ``SUPPORT``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._support import SUPPORT

#: Where Dynamo's call of a ``nonstrict_trace``'d function lands in its graph: a closure made
#: per call site, ``torch._dynamo.variables.torch.<...>.flat_apply_capture(callable, in_spec,
#: *flat_args)`` (torch 2.11 and 2.15; the callable is a ``_LeafCallable`` on 2.15, a
#: ``_ConstantFunction`` spec on 2.11). Another torch names it otherwise, and nothing is
#: rewritten.
_NONSTRICT_CAPTURE = ("torch._dynamo.variables.torch", "flat_apply_capture")
_LEAF_CALLABLE = "torch._higher_order_ops.invoke_leaf_function"


def is_nonstrict_capture(target: object) -> bool:
    """Is ``target`` Dynamo's per-call-site closure around a ``nonstrict_trace``'d call?"""
    module, name = _NONSTRICT_CAPTURE
    return getattr(target, "__module__", None) == module and getattr(target, "__name__", "") == name


_FLAT_APPLY = "torch._higher_order_ops.flat_apply"


def _constant_function_spec(value: object) -> Callable[..., Any] | None:
    """The function a ``flat_apply`` function spec (torch 2.11: Dynamo passes the nonstrict
    callable as ``func_to_graphable``'s ``TreeSpec`` of a ``_ConstantFunction``) holds, or None
    when ``value`` is not one."""
    import torch.utils._pytree as pytree

    if not isinstance(value, pytree.TreeSpec) or value.num_leaves != 0:
        return None
    constant = SUPPORT.attr(_FLAT_APPLY, "_ConstantFunction")
    try:
        unflat = pytree.tree_unflatten([], value)
    except Exception:  # a spec of something else: not ours to read
        return None
    if type(unflat) is not constant:
        return None
    fn = getattr(unflat, "func", None)
    return fn if callable(fn) else None


def _leaf_callable_class() -> Any:
    """Dynamo's ``_LeafCallable`` (torch 2.15), or None on a torch without it (2.11)."""
    if not SUPPORT.has(_LEAF_CALLABLE, "_LeafCallable"):
        return None
    return SUPPORT.attr(_LEAF_CALLABLE, "_LeafCallable")


def leaf_callable_function(value: object) -> Callable[..., Any] | None:
    """The function the callable a nonstrict call passes to ``flat_apply`` calls -- a Dynamo
    ``_LeafCallable`` (torch 2.15) or a ``_ConstantFunction`` spec (2.11) -- or None when
    ``value`` is neither."""
    leaf = _leaf_callable_class()
    if leaf is not None and type(value) is leaf:
        fn = getattr(value, "_fn", None)
        return fn if callable(fn) else None
    if SUPPORT.has(_FLAT_APPLY, "_ConstantFunction"):
        return _constant_function_spec(value)
    return None


def leaf_callable_like(original: object, fn: Callable[..., Any]) -> Any:
    """A callable of the same form as ``original`` (a ``_LeafCallable``, or a
    ``_ConstantFunction`` spec) that calls ``fn``: what ``flat_apply`` accepts in its place."""
    leaf = _leaf_callable_class()
    if leaf is not None and isinstance(original, leaf):
        return leaf(fn)
    to_graphable: Any = SUPPORT.attr(_FLAT_APPLY, "func_to_graphable")
    return to_graphable(fn)[1]


_FAKE_CLASS_REGISTRY = "torch._library.fake_class_registry"


def fake_script_object_class(value: object) -> str | None:
    """The class name a ``FakeScriptObject`` (the fake of an opaque object input, such as a
    DTensor's device mesh, in a traced graph's ``val``) stands for; None for anything else."""
    fake: Any = SUPPORT.attr(_FAKE_CLASS_REGISTRY, "FakeScriptObject")
    if not isinstance(value, fake):
        return None
    return str(value.script_class_name)


def op_overload_type() -> type:
    """``torch._ops.OpOverload``: one overload of an operator (what a traced node calls)."""
    cls: type = SUPPORT.attr("torch._ops", "OpOverload")
    return cls


def nonstrict_trace(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch._dynamo.nonstrict_trace(fn)``: Dynamo calls ``fn`` instead of tracing into it."""
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]] = SUPPORT.attr(
        "torch._dynamo", "nonstrict_trace"
    )
    return wrap(fn)


def operator_types() -> tuple[type, ...]:
    """``torch._ops``' ``OpOverload``, ``OpOverloadPacket`` and ``HigherOrderOperator``: graph
    targets named by a global schema."""
    ops: Any = SUPPORT.attrs(
        "torch._ops", ("OpOverload", "OpOverloadPacket", "HigherOrderOperator")
    )
    return (ops.OpOverload, ops.OpOverloadPacket, ops.HigherOrderOperator)
