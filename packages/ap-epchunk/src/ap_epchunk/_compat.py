"""Every torch internal ap-epchunk uses, looked up at call time and feature-detected.

See :mod:`ap_tags.torch_support` for the convention all ap packages follow. The rest of the
package reads like plain FX code and reaches torch internals only through the functions here:

* ``require_internals`` fails early, naming every missing internal and the tested versions.
* ``new_hinted_unbacked_symint`` creates a chunk symbol: an unbacked SymInt with an
  optimization hint that ``make_fx`` will not try to rebind. On torch 2.13 a symbol created by
  ``ShapeEnv.create_unbacked_symint`` stays in ``pending_fresh_unbacked_symbols`` and
  ``make_fx`` then tries to bind it to the *list* of placeholder proxies (``AssertionError:
  Expected Proxy, got [Proxy(x_1), ...]``). Creating input symbols under
  ``ShapeEnv.ignore_fresh_unbacked_symbols`` keeps them out of that list; 2.14+ behave the same
  way with or without it, so it is applied unconditionally, scoped to the creation of the
  input fakes.
* ``optimization_hint`` reads the hint an unbacked symbol was marked with (the ShapeEnv's
  ``var_to_hint_override`` table).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import sympy  # type: ignore[import-untyped]
import torch
from ap_tags import is_fsdp_chain_all_gather, torch_support
from torch.fx.experimental.symbolic_shapes import ShapeEnv

#: The torch versions ap-epchunk is tested on (the only place they are written).
TESTED_TORCH = ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0")


class UnsupportedTorchError(torch_support.UnsupportedTorchError):
    """A torch internal ap-epchunk relies on is missing from the installed torch."""


SUPPORT = torch_support.TorchSupport("ap-epchunk", TESTED_TORCH, UnsupportedTorchError)

#: Logger of torch's fake-tensor dispatch: it prints a traceback for every op that fails under
#: fake mode, and a failing static-shape probe is an answer, not an error.
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"

_SHAPE_ENV_METHODS = ("ignore_fresh_unbacked_symbols", "create_unbacked_symint")


def require_internals() -> None:
    """Raise ``UnsupportedTorchError`` naming every internal the passes need that is missing."""
    missing = [f"ShapeEnv.{name}" for name in _SHAPE_ENV_METHODS if not hasattr(ShapeEnv, name)]
    if not _has_hint_overrides():
        missing.append("ShapeEnv.var_to_hint_override")
    if not SUPPORT.has("torch._dynamo.decorators", "mark_unbacked"):
        missing.append("torch._dynamo.decorators.mark_unbacked")
    if missing:
        raise SUPPORT.missing(", ".join(missing))


def _has_hint_overrides() -> bool:
    try:
        return hasattr(ShapeEnv(), "var_to_hint_override")
    except Exception:  # noqa: BLE001 - a ShapeEnv that cannot even be built lacks it too
        return False


def mark_unbacked_fn() -> Callable[..., Any]:
    """``torch._dynamo.decorators.mark_unbacked``."""
    fn: Callable[..., Any] = SUPPORT.attr("torch._dynamo.decorators", "mark_unbacked")
    return fn


def stacktrace_preservation_hooks() -> Callable[[list[Any]], None]:
    """AOTAutograd's ``setup_stacktrace_preservation_hooks``: autograd-graph hooks that stamp
    ``autograd_backward`` and the forward ``seq_nr`` on the backward nodes traced from them."""
    fn: Callable[[list[Any]], None] = SUPPORT.attr(
        "torch._functorch._aot_autograd.logging_utils", "setup_stacktrace_preservation_hooks"
    )
    traceback = SUPPORT.module("torch.fx.traceback")
    if hasattr(traceback, "_mark_autograd_backward"):
        return fn
    # torch 2.11's hooks stamp ``seq_nr`` but not ``autograd_backward`` (2.12+ do, through
    # ``fx.traceback._mark_autograd_backward``): add hooks doing what 2.15's do to ``current_meta``.
    meta: dict[str, Any] = SUPPORT.attr("torch.fx.traceback", "current_meta")

    def mark(grad_output: Any) -> None:
        meta["autograd_backward"] = True

    def unmark(grad_input: Any, grad_output: Any) -> None:
        meta.pop("autograd_backward", None)

    def with_backward_marks(roots: list[Any]) -> None:
        fn(roots)
        for node in _autograd_nodes(roots):
            node.register_prehook(mark)
            node.register_hook(unmark)

    return with_backward_marks


def copy_backward_mark() -> Callable[[], None]:
    """Make traced nodes copy ``autograd_backward`` from the current meta; returns the undo.

    torch 2.12+ copy it already (``fx.traceback._mark_autograd_backward`` exists there: nothing
    to do). torch 2.11's tracer copies only the keys listed in ``fx.proxy._COPY_META_FIELDS``,
    so the key is appended for the scope (:func:`stacktrace_preservation_hooks` sets it) and
    removed by the undo."""
    if hasattr(SUPPORT.module("torch.fx.traceback"), "_mark_autograd_backward"):
        return lambda: None
    fields: list[str] = SUPPORT.attr("torch.fx.proxy", "_COPY_META_FIELDS")
    if "autograd_backward" in fields:
        return lambda: None
    fields.append("autograd_backward")

    def undo() -> None:
        if "autograd_backward" in fields:
            fields.remove("autograd_backward")

    return undo


def _autograd_nodes(roots: list[Any]) -> list[Any]:
    """Every node of the autograd graph under ``roots``, breadth first (``iter_graph`` of
    ``setup_stacktrace_preservation_hooks``, torch 2.15 ``_aot_autograd/logging_utils.py``)."""
    seen: set[Any] = set()
    order: list[Any] = []
    queue = [r for r in roots if r is not None]
    seen.update(queue)
    while queue:
        node = queue.pop(0)
        order.append(node)
        for fn, _idx in node.next_functions:
            if fn is not None and fn not in seen:
                seen.add(fn)
                queue.append(fn)
    return order


def fake_tensor_mode(shape_env: ShapeEnv) -> Any:
    """A ``FakeTensorMode`` over ``shape_env`` that also accepts real inputs."""
    mode_type = SUPPORT.attr("torch._subclasses.fake_tensor", "FakeTensorMode")
    return mode_type(shape_env=shape_env, allow_non_fake_inputs=True)


@functools.cache
def _pytree() -> Any:
    return SUPPORT.attrs("torch.utils._pytree", ("tree_leaves", "tree_map"))


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of a nest of lists/tuples/dicts (torch's pytree)."""
    leaves: list[Any] = _pytree().tree_leaves(tree)
    return leaves


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` with ``fn`` applied to every leaf (torch's pytree)."""
    return _pytree().tree_map(fn, tree)


def floor_div(expr: sympy.Expr, divisor: int) -> sympy.Expr:
    """``expr // divisor`` as torch's own sympy ``FloorDiv`` (what symbolic sizes are made of)."""
    floor_div_type = SUPPORT.attr("torch.utils._sympy.functions", "FloorDiv")
    result: sympy.Expr = floor_div_type(expr, divisor)
    return result


def all_reduce_op() -> Any | None:
    """``torch.ops._c10d_functional.all_reduce.default``; None when this torch lacks it (then
    no graph can contain one)."""
    try:
        return torch.ops._c10d_functional.all_reduce.default
    except (AttributeError, RuntimeError):
        return None


def new_hinted_unbacked_symint(shape_env: ShapeEnv, hint: int) -> torch.SymInt:
    """An unbacked SymInt whose optimization hint is ``hint`` and that make_fx won't rebind."""
    constrain = SUPPORT.attr("torch.fx.experimental.symbolic_shapes", "_constrain_range_for_size")
    with shape_env.ignore_fresh_unbacked_symbols():
        sym = shape_env.create_unbacked_symint()
    # size-like with a lower bound of 2, as mark_unbacked(min=...) does: tracing may then
    # decide "is this dim 0 or 1?" without guarding on the data-dependent symbol
    constrain(sym, min=2, max=None)
    shape_env.var_to_hint_override[sym.node.expr] = hint
    return sym


def optimization_hint(shape_env: ShapeEnv, symbol: sympy.Symbol) -> int | None:
    """The hint ``symbol`` was marked with, or None."""
    hint: Any = shape_env.var_to_hint_override.get(symbol)
    return int(hint) if hint is not None else None


def shape_env_of(value: Any) -> ShapeEnv | None:
    """The ShapeEnv behind a SymInt/SymFloat/SymBool or a FakeTensor with symbolic sizes."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        env: ShapeEnv | None = value.node.shape_env
        return env
    if isinstance(value, torch.Tensor):
        for s in (*value.shape, *value.stride()):
            if isinstance(s, torch.SymInt):
                env2: ShapeEnv | None = s.node.shape_env
                return env2
        fake_mode = getattr(value, "fake_mode", None)
        if fake_mode is not None and fake_mode.shape_env is not None:
            env3: ShapeEnv | None = fake_mode.shape_env
            return env3
    return None


def unbacked_bindings(node: torch.fx.Node) -> dict[Any, Any]:
    """``node``'s ``meta["unbacked_bindings"]`` as ``{symbol: (raw symbol, path)}``, keyed by
    the symbol its value mentions: the raw key through the ShapeEnv's ``unbacked_renamings``.

    Why: AOTAutograd retraces a graph Dynamo already traced, and each data-dependent op binds a
    fresh symbol there (``u26``) that torch renames to Dynamo's (``u1``) in the values while
    the binding keeps the raw name (what ``torch.fx.experimental.symbolic_shapes.
    resolve_unbacked_bindings`` resolves). A joint graph from ``make_fx`` has no renamings."""
    bindings = node.meta.get("unbacked_bindings")
    if not isinstance(bindings, dict) or not bindings:
        return {}
    env = shape_env_of(node.meta.get("val"))
    renamings = getattr(env, "unbacked_renamings", None) if env is not None else None
    out: dict[Any, Any] = {}
    for raw, path in bindings.items():
        sym = raw
        seen = {sym}
        while isinstance(renamings, dict) and sym in renamings:  # a chain u40 -> u26 -> u1
            sym = renamings[sym]
            if sym in seen:
                break
            seen.add(sym)
        out[sym] = (raw, path)
    return out


def fake_from_meta(value: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """``meta`` (a meta-device tensor) as a tensor of ``value``'s kind: a fake tensor of
    ``value``'s fake mode and device, or ``meta`` itself when ``value`` is not fake.

    Wrapping the meta tensor directly costs several times less than dispatching a factory
    through the fake mode, for each of thousands of nodes, and does not grow its cache.
    """
    fake_mode = getattr(value, "fake_mode", None)
    if fake_mode is None:
        return meta
    fake: torch.Tensor = fake_mode.fake_tensor_converter.from_meta_and_device(
        fake_mode, meta, value.device
    )
    return fake


def fresh_unbacked_like(shape_env: ShapeEnv, symbol: sympy.Symbol) -> sympy.Symbol:
    """A new unbacked symbol with ``symbol``'s value range, size-likeness and optimization
    hint: one chunk's own copy of a data-dependent value (``.item()``, ``nonzero``)."""
    with shape_env.ignore_fresh_unbacked_symbols():
        new = shape_env.create_unbacked_symint().node.expr
    ranges = getattr(shape_env, "var_to_range", None)
    if isinstance(ranges, dict) and symbol in ranges:
        ranges[new] = ranges[symbol]
    size_like = getattr(shape_env, "size_like", None)
    if isinstance(size_like, set) and symbol in size_like:
        size_like.add(new)
    hint = shape_env.var_to_hint_override.get(symbol)
    if hint is not None:
        shape_env.var_to_hint_override[new] = hint
    fresh: sympy.Symbol = new
    return fresh


def materialize_symints(graph: torch.fx.Graph, values: list[torch.SymInt]) -> list[Any] | None:
    """``values`` as FX nodes computed from the graph's own producers of their symbols, or
    ``None`` where this torch has no ``Graph.materialize_symints`` (2.11, 2.12) or cannot find
    a producer for a symbol. ``None`` means "keep the raw value": a torch without it accepts raw
    SymInt arguments, and a symbol without a producer has no other form."""
    fn = getattr(graph, "materialize_symints", None)
    if fn is None:
        return None
    try:
        return list(fn(values))
    except (AssertionError, KeyError, NotImplementedError, TypeError, ValueError):
        return None


def process_group_of(group_name: str) -> Any:
    """The ``ProcessGroup`` a functional collective's ``group_name`` argument names
    (``torch._C._distributed_c10d._resolve_process_group``, what the collectives resolve it
    with at run time)."""
    resolve: Callable[[str], Any] = SUPPORT.attr(
        "torch._C._distributed_c10d", "_resolve_process_group"
    )
    return resolve(group_name)


def fsdp_collective_predicates() -> tuple[Callable[[Any], bool], Callable[[Any], bool]]:
    """torch's own FSDP predicates ``(is_fsdp_all_gather, is_fsdp_reduce_scatter_wait)``
    (``torch._inductor.fx_passes.fsdp``): an all-gather deriving from exactly one placeholder,
    a reduce-scatter wait flowing to the outputs through single-input ops. The FSDP placement
    uses the same rules torch's FSDP bucketing filters on, not a copy of them.

    torch 2.11 has no ``is_fsdp_all_gather`` (its bucketing filters on the narrower
    ``is_fsdp_all_gather_wait``: a placeholder or one ``convert_element_type`` of it). There the
    all-gather predicate is ap-tags' FSDP chain rule, :func:`ap_tags.is_fsdp_chain_all_gather`
    (a placeholder through any single-input casts: the chains ap-tags' FSDP tagging tags), not
    a copy of 2.15's: ap-bucketing holds the one carried copy, and ap-epchunk does not depend
    on ap-bucketing."""
    module = "torch._inductor.fx_passes.fsdp"
    fsdp = SUPPORT.module(module)
    if hasattr(fsdp, "is_fsdp_all_gather") or hasattr(fsdp, "identify_fsdp_groups"):
        is_all_gather: Callable[[Any], bool] = SUPPORT.attr(module, "is_fsdp_all_gather")
    else:  # torch 2.11, which predates it
        is_all_gather = is_fsdp_chain_all_gather
    is_rs_wait: Callable[[Any], bool] = SUPPORT.attr(module, "is_fsdp_reduce_scatter_wait")
    return is_all_gather, is_rs_wait
