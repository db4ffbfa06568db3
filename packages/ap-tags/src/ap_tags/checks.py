"""Argument checks for the public entry points of the ap packages.

One convention everywhere: ``require_<kind>(value, *, where, arg)`` returns ``value`` (narrowed)
or raises before anything is read or written, naming the entry point (``where``), the argument
(``arg``), what was expected and what was passed. A value of the wrong *type* raises
``TypeError``; a value of the right type that is out of range raises ``ValueError``. Without
these, a pass handed a string fails with ``'str' object has no attribute 'nodes'`` deep inside
torch.fx.

ap-bucketing depends on torch only and keeps its own copy of the few it needs, with the same
signatures; a cross-package test holds the two to the same messages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch.fx

__all__ = [
    "describe",
    "require_bool",
    "require_callable",
    "require_graph",
    "require_graph_module",
    "require_instance",
    "require_int",
    "require_node",
    "require_nodes",
]

T = TypeVar("T")


def describe(value: object) -> str:
    """``"int 3"`` / ``"GraphModule"``: the type, plus a short repr for plain values."""
    kind = type(value).__name__
    if value is None or isinstance(value, bool | int | float | str | bytes):
        text = repr(value)
        return f"{kind} {text[:60] + '...' if len(text) > 63 else text}"
    return kind


def _type_error(where: str, arg: str, expected: str, value: object) -> TypeError:
    return TypeError(f"{where}: {arg} must be {expected}, got {describe(value)}")


def require_instance(
    value: object, types: type[T] | tuple[type[T], ...], *, where: str, arg: str, expected: str
) -> T:
    """``value`` when it is an instance of ``types`` (``expected`` names them in the message)."""
    if not isinstance(value, types):
        raise _type_error(where, arg, expected, value)
    return value


def require_bool(value: object, *, where: str, arg: str) -> bool:
    return require_instance(value, bool, where=where, arg=arg, expected="a bool")


def require_int(value: object, *, where: str, arg: str, minimum: int | None = None) -> int:
    """A real int (``bool`` is refused: ``True`` is never a count or an index)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(where, arg, "an int", value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{where}: {arg} must be >= {minimum}, got {value}")
    return value


def require_callable(
    value: object, *, where: str, arg: str, optional: bool = False
) -> Callable[..., Any] | None:
    if value is None and optional:
        return None
    if not callable(value):
        raise _type_error(where, arg, "a callable or None" if optional else "callable", value)
    return value


def require_graph(value: object, *, where: str, arg: str = "graph") -> torch.fx.Graph:
    """The ``torch.fx.Graph`` behind a Graph or a GraphModule."""
    if isinstance(value, torch.fx.GraphModule):
        return value.graph
    if isinstance(value, torch.fx.Graph):
        return value
    raise _type_error(where, arg, "a torch.fx.Graph or torch.fx.GraphModule", value)


def require_graph_module(value: object, *, where: str, arg: str = "gm") -> torch.fx.GraphModule:
    return require_instance(
        value, torch.fx.GraphModule, where=where, arg=arg, expected="a torch.fx.GraphModule"
    )


def require_node(value: object, *, where: str, arg: str = "node") -> torch.fx.Node:
    return require_instance(value, torch.fx.Node, where=where, arg=arg, expected="a torch.fx.Node")


def require_nodes(value: object, *, where: str, arg: str) -> list[torch.fx.Node]:
    """An iterable of nodes (not a string), as a list."""
    if not isinstance(value, Iterable) or isinstance(value, str | bytes):
        raise _type_error(where, arg, "an iterable of torch.fx.Node", value)
    nodes = list(value)
    for item in nodes:
        if not isinstance(item, torch.fx.Node):
            raise _type_error(where, arg, "an iterable of torch.fx.Node", item)
    return nodes
