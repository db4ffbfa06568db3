"""Substituting symbols inside FX values (SymInts, fake tensors, nested tuples).

Both directions of the package use it: the chunk pass rewrites a chunk symbol ``u`` to
``u // N`` in the values of chunk copies, and concretization rewrites it to its hint. Only the
given symbols are touched; every other symbol in an expression survives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sympy  # type: ignore[import-untyped]
import torch

from ._compat import fake_from_meta

SymMap = Mapping[sympy.Symbol, sympy.Expr]


def free_symbols(value: Any) -> set[sympy.Symbol]:
    """Every sympy symbol in ``value`` (SymInt/SymFloat/SymBool, tensor shape/stride, nests)."""
    found: set[sympy.Symbol] = set()

    def visit(v: Any) -> None:
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            found.update(v.node.expr.free_symbols)
        elif isinstance(v, torch.Tensor):
            for s in (*v.shape, *v.stride()):
                visit(s)
            try:
                visit(v.storage_offset())
            except (RuntimeError, NotImplementedError):  # pragma: no cover - exotic layouts
                pass
        elif isinstance(v, (list, tuple)):
            for item in v:
                visit(item)
        elif isinstance(v, dict):
            for item in v.values():
                visit(item)
        elif isinstance(v, sympy.Basic):
            found.update(v.free_symbols)

    visit(value)
    return found


def subst_scalar(value: Any, mapping: SymMap, cache: dict[Any, Any] | None = None) -> Any:
    """``value`` with ``mapping`` applied; a fully numeric result becomes a Python scalar.

    ``cache`` (keyed by expression and kind) lets a pass reuse one result per distinct
    expression instead of re-substituting the same ``u0`` thousands of times.
    """
    if not isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return value
    expr = value.node.expr
    if not (expr.free_symbols & mapping.keys()):
        return value
    if cache is not None:
        key = (type(value), expr)
        if key not in cache:
            cache[key] = _subst_scalar(value, expr, mapping)
        return cache[key]
    return _subst_scalar(value, expr, mapping)


def _subst_scalar(value: Any, expr: sympy.Expr, mapping: SymMap) -> Any:
    new = expr.xreplace(dict(mapping))
    env = value.node.shape_env
    assert env is not None, f"symbolic value {value} has no ShapeEnv"
    if isinstance(value, torch.SymBool):
        if new in (sympy.true, sympy.false) or isinstance(new, bool):
            return bool(new)
        return env.create_symboolnode(new)
    if isinstance(value, torch.SymFloat):
        if not new.free_symbols:
            return float(new)
        return env.create_symfloatnode(new, hint=None)
    if not new.free_symbols:
        return int(new)
    return env.create_symintnode(new, hint=None)


def subst_value(value: Any, mapping: SymMap, cache: dict[Any, Any] | None = None) -> Any:
    """Apply ``mapping`` to a meta value: scalars, fake tensors (shape and stride), nests."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return subst_scalar(value, mapping, cache)
    if isinstance(value, torch.Tensor):
        if not (free_symbols(value) & mapping.keys()):
            return value
        shape = [subst_scalar(s, mapping, cache) for s in value.shape]
        stride = [subst_scalar(s, mapping, cache) for s in value.stride()]
        return new_fake_like(value, shape, stride)
    if isinstance(value, tuple):
        return tuple(subst_value(v, mapping, cache) for v in value)
    if isinstance(value, list):
        return [subst_value(v, mapping, cache) for v in value]
    return value


def new_fake_like(value: torch.Tensor, shape: list[Any], stride: list[Any]) -> torch.Tensor:
    """A tensor of ``value``'s kind (fake mode, dtype, device) with a new shape and stride."""
    meta = torch.empty_strided(shape, stride, dtype=value.dtype, device="meta")
    return fake_from_meta(value, meta)


def expr_of(value: Any) -> sympy.Expr | None:
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        e: sympy.Expr = value.node.expr
        return e
    return None


__all__ = [
    "free_symbols",
    "subst_scalar",
    "subst_value",
    "new_fake_like",
    "expr_of",
]
