"""Argument checks shared by the public entry points: wrong kinds of objects fail early with a
``TypeError`` naming the function, the argument, what it expects and what it got."""

from __future__ import annotations

import math

import torch.fx as fx


def require_graph_module(function: str, name: str, value: object) -> fx.GraphModule:
    if not isinstance(value, fx.GraphModule):
        raise TypeError(
            f"{function}: {name} must be a torch.fx.GraphModule, got {type(value).__name__}"
        )
    return value


def require_callable(function: str, name: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not callable(value):
        kind = "a callable or None" if optional else "callable"
        raise TypeError(f"{function}: {name} must be {kind}, got {type(value).__name__}")


def require_bool(function: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{function}: {name} must be a bool, got {type(value).__name__}")
    return value


def require_cap_mb(value: object, index: int) -> float:
    """A cap function's result: a positive finite number of MiB."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"bucket_collectives: cap_fn returned {value!r} for bucket {index}; expected a "
            f"positive finite number of MiB"
        )
    return float(value)
