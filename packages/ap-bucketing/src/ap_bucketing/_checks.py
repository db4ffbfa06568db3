"""Argument checks for ap-bucketing's public entry points.

The workspace convention (``docs/architecture.md``, "Shared vocabulary and conventions"):
``require_<kind>(value, *, where, arg)`` returns ``value`` or raises before anything is read or
written, with the message ``"{where}: {arg} must be {expected}, got {describe(value)}"``. A
value of the wrong *type* raises ``TypeError``; the right type out of range raises
``ValueError``. ap-bucketing depends on torch only, so it keeps its own copies of the few checks
it needs; a cross-package test holds them to ``ap_tags.checks``' messages.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch.fx as fx

T = TypeVar("T")

_PLAIN = (type(None), bool, int, float, str, bytes)


def describe(value: object) -> str:
    """``"int 3"`` / ``"GraphModule"``: the type, plus a short repr for plain values."""
    name = type(value).__name__
    if not isinstance(value, _PLAIN):
        return name
    text = repr(value)
    return f"{name} {text if len(text) <= 63 else text[:60] + '...'}"


def _wrong_type(where: str, arg: str, expected: str, value: object) -> TypeError:
    return TypeError(f"{where}: {arg} must be {expected}, got {describe(value)}")


def require_instance(
    value: object, types: type[T] | tuple[type[T], ...], *, where: str, arg: str, expected: str
) -> T:
    """``value`` when it is an instance of ``types`` (``expected`` names them in the message)."""
    if isinstance(value, types):
        return value
    raise _wrong_type(where, arg, expected, value)


def require_bool(value: object, *, where: str, arg: str) -> bool:
    return require_instance(value, bool, where=where, arg=arg, expected="a bool")


def require_int(value: object, *, where: str, arg: str, minimum: int | None = None) -> int:
    """A real int (``bool`` is refused: ``True`` is never a count or a span)."""
    if type(value) is bool or not isinstance(value, int):
        raise _wrong_type(where, arg, "an int", value)
    if minimum is None or value >= minimum:
        return value
    raise ValueError(f"{where}: {arg} must be >= {minimum}, got {value}")


def require_mib(value: object, *, where: str, arg: str) -> float:
    """A positive finite number of MiB (int or float, not bool), as a float."""
    expected = "a positive finite number of MiB"
    if type(value) is bool or not isinstance(value, int | float):
        raise _wrong_type(where, arg, expected, value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{where}: {arg} must be {expected}, got {describe(value)}")
    return float(value)


def require_callable(
    value: object, *, where: str, arg: str, optional: bool = False
) -> Callable[..., Any] | None:
    if callable(value) or (optional and value is None):
        return value
    raise _wrong_type(where, arg, "a callable or None" if optional else "callable", value)


def require_graph(value: object, *, where: str, arg: str = "graph") -> fx.Graph:
    """The ``torch.fx.Graph`` behind a Graph or a GraphModule."""
    graph = value.graph if isinstance(value, fx.GraphModule) else value
    expected = "a torch.fx.Graph or torch.fx.GraphModule"
    return require_instance(graph, fx.Graph, where=where, arg=arg, expected=expected)


def require_graph_module(value: object, *, where: str, arg: str = "gm") -> fx.GraphModule:
    expected = "a torch.fx.GraphModule"
    return require_instance(value, fx.GraphModule, where=where, arg=arg, expected=expected)


def require_node(value: object, *, where: str, arg: str = "node") -> fx.Node:
    return require_instance(value, fx.Node, where=where, arg=arg, expected="a torch.fx.Node")
