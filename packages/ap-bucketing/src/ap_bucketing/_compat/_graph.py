"""Ops and graph helpers: the functional collectives' overloads, ``_foreach_copy_``, torch's
``OrderedSet``, Inductor's stable topological sort, an fx graph's name table, and a SymInt's
hint read without a guard.

Part of the compat seam (:mod:`ap_bucketing._compat`): every private torch name is looked
up at call time, through :func:`~ap_bucketing._compat._support.attr` and
:func:`~ap_bucketing._compat._support.module`."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from ._support import _ABSENT, T, attr, missing

if TYPE_CHECKING:
    from torch.utils._ordered_set import OrderedSet


@functools.cache
def foreach_copy() -> Any:
    """``torch._foreach_copy_(dsts, srcs)``: each ``srcs[i]`` copied (and cast) into
    ``dsts[i]`` in one call -- on CUDA one multi-tensor kernel where a ``copy_`` per tensor
    launches one kernel each (the coalesced form's pack of a bucket's shards)."""
    return attr("torch", "_foreach_copy_")


def c10d_ops(*names: str) -> tuple[Any, ...]:
    """The ``.default`` overloads of functional collectives (``torch.ops._c10d_functional``)."""
    found = []
    for name in names:
        try:
            found.append(getattr(torch.ops._c10d_functional, name).default)
        except (AttributeError, RuntimeError) as exc:
            raise missing(f"torch.ops._c10d_functional.{name}") from exc
    return tuple(found)


def op_overload_type() -> type:
    """``torch._ops.OpOverload``: the type of an ATen/custom op target in an FX graph."""
    op_type: type = attr("torch._ops", "OpOverload")
    return op_type


def wait_tensor_op() -> Any:
    """The functional ``wait_tensor`` overload every bucketing predicate keys on."""
    return c10d_ops("wait_tensor")[0]


def fsdp_all_gather_ops() -> tuple[Any, ...]:
    """The all-gathers torch's FSDP detection looks at (``_find_all_gathers``' order)."""
    return c10d_ops("all_gather_into_tensor", "all_gather_into_tensor_out")


def sizable_collective_ops() -> tuple[Any, ...]:
    """The collectives torch's bucketing may size (all-gathers, reduce-scatters, all-reduces)."""
    return c10d_ops(
        "all_gather_into_tensor",
        "all_gather_into_tensor_out",
        "reduce_scatter_tensor",
        "all_reduce",
    )


def ordered_set(items: Iterable[T] = ()) -> OrderedSet[T]:
    """torch's ``OrderedSet`` of ``items``: what ``identify_fsdp_groups`` returns."""
    cls: type[OrderedSet[T]] = attr("torch.utils._ordered_set", "OrderedSet")
    return cls(items)


def stable_topological_sort(graph: torch.fx.Graph) -> None:
    """Inductor's in-place topological sort that keeps already-valid orders unchanged."""
    attr("torch._inductor.pattern_matcher", "stable_topological_sort")(graph)


def reset_graph_namespace(graph: torch.fx.Graph) -> None:
    """Give ``graph`` a fresh name table (``Graph._graph_namespace``), so nodes copied back
    into an emptied graph keep their names instead of getting ``_1`` suffixes."""
    namespace: Any = getattr(graph, "_graph_namespace", _ABSENT)
    if namespace is _ABSENT:
        raise missing("torch.fx.Graph._graph_namespace")
    setattr(graph, "_graph_namespace", type(namespace)())  # noqa: B010 (a private attribute)


#: What torch's bucketing raises when a merged bucket's region cannot be reordered
#: (``graph_deduplication._stable_topological_sort_region``, torchtitan#4047).
REGION_SORT_FAILURE = "stable topological sort of region failed"


def symint_hint(value: torch.SymInt) -> int | None:
    """A concrete int for a SymInt from hints only, or ``None`` when a symbol has none.

    The node's own hint when it has one; otherwise the expression with the ShapeEnv's
    replacements, backed values (``backed_var_to_val`` from 2.15, ``var_to_val`` before) and
    ``var_to_hint_override`` entries substituted, unknown when a free symbol remains. Never
    installs a guard.
    """
    node: Any = value.node
    hint = getattr(node, "_hint", None)
    if hint is not None:
        return int(hint)
    shape_env = getattr(node, "shape_env", None)
    if shape_env is None:
        return None
    import sympy  # type: ignore[import-untyped]

    expr: Any = sympy.sympify(node.expr)
    backed = "backed_var_to_val" if hasattr(shape_env, "backed_var_to_val") else "var_to_val"
    for table in ("replacements", backed, "var_to_hint_override"):
        mapping = getattr(shape_env, table, None)
        if mapping:
            expr = expr.xreplace(mapping)
    if isinstance(expr, sympy.Expr):
        expr = expr.expand(identity=True)
    if getattr(expr, "free_symbols", None):
        return None
    try:
        return int(expr)
    except (TypeError, ValueError):
        return None
