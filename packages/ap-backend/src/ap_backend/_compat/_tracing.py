"""What the first compilation traces with: fx's node-meta state, pytree, fake modes, the joint
export API, the errors a data-dependent trace raises, the dynamic-dim marks.

Part of the compat seam (:mod:`ap_backend._compat`): every private torch name is looked up
at call time through ``SUPPORT``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from ap_tags.scoped import ScopedPatch

from ._support import SUPPORT

_AOT_AUTOGRAD = "torch._functorch.aot_autograd"


@contextlib.contextmanager
def pristine_fx_traceback() -> Any:
    """``torch.fx.traceback``'s node-meta state (module globals, not thread-local) as a
    process starts with it, for the block, restored on exit.

    Why: a first compilation made while another trace runs (the second compilation's retrace
    on a cache miss) would otherwise copy that trace's current node meta -- Dynamo's
    ``source_fn_stack`` of the call -- onto every node it creates, and differ from the same
    first compilation made by ``precompile``."""
    tb: Any = SUPPORT.attrs(
        "torch.fx.traceback",
        ("current_meta", "should_preserve_node_meta", "_should_preserve_node_meta"),
    )
    names: tuple[str, ...] = (
        "current_meta",
        "should_preserve_node_meta",
        "_should_preserve_node_meta",
    )
    fresh: dict[str, Any] = {
        "current_meta": {},
        "should_preserve_node_meta": False,
        "_should_preserve_node_meta": False,
    }
    if hasattr(tb, "current_replay_node"):
        names = (*names, "current_replay_node")
        fresh["current_replay_node"] = None
    saved = {name: getattr(tb, name) for name in names}
    for name, value in fresh.items():
        setattr(tb, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(tb, name, value)


def make_fx() -> Callable[..., Any]:
    """``torch.fx.experimental.proxy_tensor.make_fx``."""
    fn: Callable[..., Any] = SUPPORT.attr("torch.fx.experimental.proxy_tensor", "make_fx")
    return fn


def pytree() -> Any:
    """``torch.utils._pytree`` (``tree_map``, ``tree_leaves``, ``tree_flatten``,
    ``tree_unflatten``): the flattening AOTAutograd and export use."""
    module: Any = SUPPORT.attrs(
        "torch.utils._pytree", ("tree_map", "tree_leaves", "tree_flatten", "tree_unflatten")
    )
    return module


def fake_tree(tree: Any, fake_mode: Any) -> Any:
    """``tree`` with every tensor replaced by its static-shaped fake in ``fake_mode``."""

    def fake(value: object) -> object:
        if isinstance(value, torch.Tensor):
            return fake_mode.from_tensor(value, static_shapes=True)
        return value

    return pytree().tree_map(fake, tree)


def fake_propagation_mode(values: Sequence[Any]) -> Any:
    """The fake mode of ``values`` when a compiler's trace is on (a ``TracingContext``) and
    they are plain fake tensors seen by no tracer (no proxy or functionalization mode on): how
    Dynamo runs a ``nonstrict_trace``'d callable to learn its outputs. None otherwise: a real
    call, a trace that records the call, or a user's own fake-tensor run outside any compile
    (which must get real autograd outputs, not a description of them)."""
    fake_type: Any = SUPPORT.attr("torch._subclasses.fake_tensor", "FakeTensor")
    keys: Any = SUPPORT.attr("torch._C", "_TorchDispatchModeKey")
    get_mode: Any = SUPPORT.attr("torch._C", "_get_dispatch_mode")
    context: Any = SUPPORT.attr("torch._guards", "TracingContext")
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors or not all(type(t) is fake_type for t in tensors):
        return None
    if context.try_get() is None:
        return None
    if get_mode(keys.PROXY) is not None or get_mode(keys.FUNCTIONAL) is not None:
        return None
    first: Any = tensors[0]
    return first.fake_mode


def custom_op_functions(qualname: str) -> list[Callable[..., Any]]:
    """The Python functions a ``torch.library.custom_op`` named ``qualname`` runs (its
    implementation and its registered autograd); ``[]`` for an op defined otherwise."""
    opdefs: Any = SUPPORT.attr("torch._library.custom_ops", "OPDEFS")
    opdef = opdefs.get(qualname)
    if opdef is None:
        return []
    names = ("_init_fn", "_backward_fn", "_setup_context_fn")
    return [fn for fn in (getattr(opdef, n, None) for n in names) if callable(fn)]


def global_module_backward_hooks() -> bool:
    """Is a global module backward hook registered (``register_module_full_backward_hook``)?"""
    hooks: Any = SUPPORT.attrs(
        "torch.nn.modules.module", ("_global_backward_hooks", "_global_backward_pre_hooks")
    )
    return bool(hooks._global_backward_hooks or hooks._global_backward_pre_hooks)


# --------------------------------------------------------------------------- first compilation


def joint_export_api() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(aot_export_joint_with_descriptors, aot_compile_joint_with_descriptors)``."""
    names = ("aot_export_joint_with_descriptors", "aot_compile_joint_with_descriptors")
    module: Any = SUPPORT.attrs(_AOT_AUTOGRAD, names)
    return module.aot_export_joint_with_descriptors, module.aot_compile_joint_with_descriptors


def _set_compiling_flag() -> Callable[[], None]:
    compiler: Any = SUPPORT.attrs("torch.compiler", ("_is_compiling_flag",))
    old = compiler._is_compiling_flag
    compiler._is_compiling_flag = True

    def undo() -> None:
        compiler._is_compiling_flag = old

    return undo


#: ``torch.compiler.is_compiling()`` answers True inside the block (a ScopedPatch), as it does while Dynamo
#: traces and while ``torch.export`` traces non-strictly (which sets the same flag).
COMPILING = ScopedPatch("torch.compiler.is_compiling() = True", _set_compiling_flag)


def fake_mode_with_shape_env() -> Any:
    """A fresh ``FakeTensorMode`` over a fresh ``ShapeEnv`` (real tensors allowed in).

    Why: ``aot_export_joint_with_descriptors`` takes the fake mode of its inputs when they have
    one, and otherwise makes one *without* a shape environment, where a tensor read into Python
    (``.tolist()`` of split sizes, ``.item()``) cannot become a symbol and fails. With inputs
    in this mode such reads become unbacked SymInts, as under Dynamo with
    ``capture_scalar_outputs``; the parameters, which are not among the inputs, are fakified
    static by AOTAutograd (``static_weight_shapes``)."""
    mode_type: Any = SUPPORT.attr("torch._subclasses.fake_tensor", "FakeTensorMode")
    shape_env_type: Any = SUPPORT.attr("torch.fx.experimental.symbolic_shapes", "ShapeEnv")
    return mode_type(shape_env=shape_env_type(), allow_non_fake_inputs=True)


def data_dependent_errors() -> dict[type[BaseException], str]:
    """The exceptions tracing with fake tensors raises when Python needs a tensor's value,
    each with the kind of code that causes it."""
    fake: Any = SUPPORT.attrs(
        "torch._subclasses.fake_tensor",
        ("DataDependentOutputException", "DynamicOutputShapeException"),
    )
    shapes: Any = SUPPORT.attrs(
        "torch.fx.experimental.symbolic_shapes", ("GuardOnDataDependentSymNode",)
    )
    return {
        fake.DataDependentOutputException: "reads a tensor's value into Python",
        fake.DynamicOutputShapeException: "calls an op whose output shape depends on values",
        shapes.GuardOnDataDependentSymNode: "branches on a value known only at run time",
    }


def tree_leaves_with_path(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    """``([(keystr(path), leaf), ...], treespec)``: torch's pytree flattening (the one
    export uses), each leaf with a printable path such as ``[1]['labels']``."""
    pytree: Any = SUPPORT.attrs(
        "torch.utils._pytree", ("tree_flatten_with_path", "keystr", "tree_flatten")
    )
    pairs, spec = pytree.tree_flatten_with_path(tree)
    return [(pytree.keystr(path), leaf) for path, leaf in pairs], spec


#: Tensor attributes ``torch._dynamo.mark_dynamic`` / ``mark_unbacked`` set: dims the user
#: asked to keep symbolic (``maybe_mark_dynamic``'s weak marks allow specialisation).
_DYNAMIC_MARKS = {
    "_dynamo_dynamic_indices": "torch._dynamo.mark_dynamic",
    "_dynamo_unbacked_indices": "torch._dynamo.decorators.mark_unbacked",
    "_dynamo_strict_unbacked_indices": "torch._dynamo.decorators.mark_unbacked(strict=True)",
}


def dynamic_dim_marks(tensor: torch.Tensor) -> dict[str, tuple[int, ...]]:
    """``{marking API: dims}`` for every dim of ``tensor`` marked to stay symbolic."""
    marks: dict[str, tuple[int, ...]] = {}
    for attr, api in _DYNAMIC_MARKS.items():
        dims = getattr(tensor, attr, None)
        if dims:
            marks[api] = tuple(sorted(int(d) for d in dims))
    return marks
