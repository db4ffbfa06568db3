"""Every private torch name ap-backend uses, looked up at call time and feature-detected.

See :mod:`ap_tags.torch_support` for the convention all ap packages follow. Nothing here runs
at import time: importing ``ap_backend`` on a torch that lacks one of these internals works,
and the feature that needs it raises :class:`UnsupportedTorchError` naming it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from ap_tags import torch_support
from ap_tags.graph import is_rng_op
from ap_tags.scoped import ScopedPatch

#: The torch versions ap-backend is tested on (the only place they are written).
TESTED_TORCH = ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0")


class UnsupportedTorchError(torch_support.UnsupportedTorchError):
    """A torch internal ap-backend relies on is missing from the installed torch."""


SUPPORT = torch_support.TorchSupport("ap-backend", TESTED_TORCH, UnsupportedTorchError)
log = logging.getLogger(__name__)

_INDUCTOR_CONFIG = "torch._inductor.config"
_FUNCTORCH_CONFIG = "torch._functorch.config"
_COMPILE_FX = "torch._inductor.compile_fx"
_CUSTOM_GRAPH_PASS = "torch._inductor.custom_graph_pass"
_AOT_AUTOGRAD = "torch._functorch.aot_autograd"
#: The logger ``TORCH_TRACE`` attaches its handler to (structured trace artifacts).
_TRACE_LOGGER = "torch.__trace"


# --------------------------------------------------------------------------- config scopes


def inductor_config_patch(changes: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """``torch._inductor.config.patch(changes)``: set for the block, restored on exit."""
    config: Any = SUPPORT.attrs(_INDUCTOR_CONFIG, ("patch",))
    patch: contextlib.AbstractContextManager[Any] = config.patch(changes)
    return patch


def functorch_config_patch(changes: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """``torch._functorch.config.patch(changes)``: set for the block, restored on exit."""
    config: Any = SUPPORT.attrs(_FUNCTORCH_CONFIG, ("patch",))
    patch: contextlib.AbstractContextManager[Any] = config.patch(changes)
    return patch


def dynamo_config_patch(changes: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """``torch._dynamo.config.patch(changes)``: set for the block, restored on exit."""
    config: Any = SUPPORT.attrs("torch._dynamo.config", ("patch",))
    patch: contextlib.AbstractContextManager[Any] = config.patch(changes)
    return patch


# --------------------------------------------------------------------------- Inductor entry points


def compile_fx() -> Callable[..., Any]:
    """Inductor's ``compile_fx`` (the ``"inductor"`` backend with ``inner_compile=`` and
    ``config_patches=`` hooks)."""
    fn: Callable[..., Any] = SUPPORT.attr(_COMPILE_FX, "compile_fx")
    return fn


def compile_fx_inner() -> Callable[..., Any]:
    """Inductor's ``compile_fx_inner``, looked up on every call (so a patched one is honoured)."""
    fn: Callable[..., Any] = SUPPORT.attr(_COMPILE_FX, "compile_fx_inner")
    return fn


def inductor_partition_fn() -> Callable[..., Any]:
    """Inductor's ``partition_fn``: its joint-graph passes, then ``custom_partitioner_fn``."""
    fn: Callable[..., Any] = SUPPORT.attr(_COMPILE_FX, "partition_fn")
    return fn


def aot_autograd_backend(**kwargs: Any) -> Callable[..., Any]:
    """``torch._dynamo.backends.common.aot_autograd(**kwargs)``: a Dynamo backend that runs
    AOTAutograd with the given compilers and ``partition_fn``."""
    make: Callable[..., Callable[..., Any]] = SUPPORT.attr(
        "torch._dynamo.backends.common", "aot_autograd"
    )
    return make(**kwargs)


# --------------------------------------------------------------------------- partitioners


@functools.cache
def custom_partitioner_type() -> type:
    """``torch._inductor.custom_graph_pass.CustomPartitionerFn``: what Inductor accepts as
    ``config.custom_partitioner_fn`` (it checks ``isinstance``)."""
    cls: type = SUPPORT.attr(_CUSTOM_GRAPH_PASS, "CustomPartitionerFn")
    return cls


def is_custom_partitioner(value: object) -> bool:
    return isinstance(value, custom_partitioner_type())


def as_custom_partitioner(value: Any) -> Any:
    """``value``, with its class registered as a virtual ``CustomPartitionerFn`` subclass.

    ap-backend's own partitioner wrappers are plain classes (so importing ap-backend needs no
    torch internal); Inductor's ``isinstance`` check passes once the class is registered with
    the ABC, which this does on first use.
    """
    base: Any = custom_partitioner_type()
    if not isinstance(value, base):
        base.register(type(value))
    return value


def hash_files(paths: tuple[str, ...]) -> bytes:
    """``get_hash_for_files(paths)``: Inductor's content hash for a partitioner's ``uuid()``."""
    fn: Callable[[tuple[str, ...]], bytes] = SUPPORT.attr(_CUSTOM_GRAPH_PASS, "get_hash_for_files")
    return fn(paths)


def hash_package_sources(packages: Sequence[ModuleType]) -> bytes:
    """:func:`hash_files` over every ``*.py`` of each package's directory: what changes when
    the code of a pass (or of what a cache key stands for) changes."""
    files = tuple(
        sorted(str(f) for pkg in packages for f in Path(str(pkg.__file__)).parent.glob("*.py"))
    )
    return hash_files(files)


# --------------------------------------------------------------------------- first compilation records


def portable_configs() -> tuple[dict[str, Any], dict[str, Any]]:
    """``save_config_portable()`` of Inductor's and functorch's config: the settings a cache
    key may cover (torch's own AOTAutograd cache keys on the same)."""
    inductor: Any = SUPPORT.attrs(_INDUCTOR_CONFIG, ("save_config_portable",))
    functorch: Any = SUPPORT.attrs(_FUNCTORCH_CONFIG, ("save_config_portable",))
    return inductor.save_config_portable(), functorch.save_config_portable()


def config_snapshot() -> tuple[dict[str, Any], dict[str, Any]]:
    """``get_config_copy()`` of Inductor's and functorch's config."""
    inductor: Any = SUPPORT.attrs(_INDUCTOR_CONFIG, ("get_config_copy",))
    functorch: Any = SUPPORT.attrs(_FUNCTORCH_CONFIG, ("get_config_copy",))
    return inductor.get_config_copy(), functorch.get_config_copy()


@contextlib.contextmanager
def configs_as(snapshot: tuple[dict[str, Any], dict[str, Any]]) -> Any:
    """Inductor's and functorch's config set back to ``snapshot`` (:func:`config_snapshot`)
    for the block: only the entries that differ are patched, restored on exit."""
    inductor: Any = SUPPORT.attrs(_INDUCTOR_CONFIG, ("get_config_copy",))
    functorch: Any = SUPPORT.attrs(_FUNCTORCH_CONFIG, ("get_config_copy",))
    now_i, now_f = inductor.get_config_copy(), functorch.get_config_copy()
    then_i, then_f = snapshot
    with (
        inductor_config_patch(_changed(now_i, then_i)),
        functorch_config_patch(_changed(now_f, then_f)),
    ):
        yield


def _changed(now: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``then`` whose value ``now`` no longer has."""
    changed = {}
    for key, value in then.items():
        try:
            same = bool(now.get(key) == value)
        except Exception:  # a value without a plain equality
            same = now.get(key) is value
        if not same:
            changed[key] = value
    return changed


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


def caches_on() -> bool:
    """Are Inductor's FX-graph cache and AOTAutograd's cache both on (what a warm start
    needs: the second compilation served from them)?"""
    inductor: Any = SUPPORT.attrs(_INDUCTOR_CONFIG, ("fx_graph_cache", "force_disable_caches"))
    functorch: Any = SUPPORT.attrs(_FUNCTORCH_CONFIG, ("enable_autograd_cache",))
    return bool(
        inductor.fx_graph_cache
        and functorch.enable_autograd_cache
        and not inductor.force_disable_caches
    )


def inductor_cache_dir() -> str:
    """Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR`` or its default)."""
    fn: Callable[[], str] = SUPPORT.attr("torch._inductor.runtime.cache_dir_utils", "cache_dir")
    return fn()


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


#: The logger of Inductor's FSDP pre-bucketing pass (INFO ``pre_bucket_fsdp_collectives: ...``
#: on every compile; the demo filters it unless ``--verbose``).
FSDP_PASS_LOGGER = "torch._inductor.fx_passes.fsdp"


def default_partition() -> Callable[..., Any]:
    """torch's ``default_partition`` (saves what the forward computed, recomputes nothing
    beyond the tags)."""
    fn: Callable[..., Any] = SUPPORT.attr("torch._functorch.partitioners", "default_partition")
    return fn


def min_cut_partition() -> Callable[..., Any]:
    """torch's ``min_cut_rematerialization_partition`` (what Inductor partitions with: saves a
    min-cut of the joint graph, recomputing cheap pointwise work in the backward; honours the
    ``recompute`` tags)."""
    fn: Callable[..., Any] = SUPPORT.attr(
        "torch._functorch.partitioners", "min_cut_rematerialization_partition"
    )
    return fn


def partitioner_op_types() -> Any:
    """torch's partitioner op classes (``get_default_op_list()``: ``is_fusible``,
    ``is_view``), the ones min-cut decides "materialized in the backward" with."""
    fn: Callable[[], Any] = SUPPORT.attr("torch._functorch.partitioners", "get_default_op_list")
    return fn()


def inductor_joint_graph_passes(
    gm: torch.fx.GraphModule, joint_inputs: Any
) -> torch.fx.GraphModule:
    """Inductor's joint-graph passes, as its ``partition_fn`` runs them before min-cut
    (``compile_fx._recursive_joint_graph_passes`` on the joint inputs' device): pattern
    rewrites such as the cross-entropy backward's ``scatter`` over a constant into
    ``where(iota == target, ...)``, constant folding, no-op removal.

    Two differences from Inductor's own call, both because this graph is interpreted and
    retraced rather than lowered: ``fallback_random=True`` keeps aten's random ops (Inductor's
    ``replace_random_passes`` would put its seed prims into the first compilation's graphs;
    the second compilation's Inductor applies it to its own graph), and the passes run under the
    joint graph's fake mode (``V.fake_mode``), which Inductor's compile would have set."""
    passes: Callable[..., torch.fx.GraphModule] = SUPPORT.attr(
        _COMPILE_FX, "_recursive_joint_graph_passes"
    )
    devices: Callable[..., Any] = SUPPORT.attr(_COMPILE_FX, "get_inputs_devices")
    virtualized: Any = SUPPORT.attr("torch._inductor.virtualized", "V")
    detect: Callable[..., Any] = SUPPORT.attr("torch._guards", "detect_fake_mode")
    found = devices(joint_inputs, gm)
    fake = detect(joint_inputs)
    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config_patch({"fallback_random": True}))
        if fake is not None:
            stack.enter_context(virtualized.set_fake_mode(fake))
        return passes(gm, skip_invoke_subgraph=True, input_device=next(iter(found), None))


def inductor_decompositions() -> dict[Any, Callable[..., Any]]:
    """Inductor's decomposition table (``torch._inductor.decomposition.select_decomp_table``):
    the ops Inductor's own min-cut partitions over, so a min-cut first partition traced with it
    sees the graph the backend's Inductor compile would partition.

    Inductor's lowering module is imported first, as Inductor's own compile has by then: some
    decompositions read it at trace time (torch 2.11's ``_max_pool_with_indices`` calls
    ``torch._inductor.lowering``; timm's ResNet-10t failed with "module 'torch._inductor' has no
    attribute 'lowering'")."""
    SUPPORT.module("torch._inductor.lowering")
    fn: Callable[[], dict[Any, Callable[..., Any]]] = SUPPORT.attr(
        "torch._inductor.decomposition", "select_decomp_table"
    )
    return fn()


# --------------------------------------------------------------------------- structured trace


def trace_structured() -> Callable[..., Any]:
    """``torch._logging.trace_structured``: writes an artifact into ``TORCH_TRACE``."""
    fn: Callable[..., Any] = SUPPORT.attr("torch._logging._internal", "trace_structured")
    return fn


def structured_tracing() -> bool:
    """Is ``TORCH_TRACE`` structured logging on (so artifact payloads are written)?

    Any handler on torch's trace logger counts, except torch's own ``LazyTraceHandler`` when
    it will drop itself at its first record: without a ``TORCH_TRACE`` directory, an
    open-source build's handler (``torch.version.git_version``, no ``MAST_HPC_JOB_NAME``)
    writes nothing and removes itself then, the rule its ``emit`` applies. Until a compile has
    logged once it is still attached, so a bare ``handlers`` check said "on" to every
    ``precompile`` that ran before the first ``torch.compile``."""
    return any(_trace_handler_writes(h) for h in logging.getLogger(_TRACE_LOGGER).handlers)


def _trace_handler_writes(handler: logging.Handler) -> bool:
    if type(handler).__name__ != "LazyTraceHandler":
        return True
    if getattr(handler, "stream", None) is not None or getattr(handler, "root_dir", None):
        return True
    import torch.version

    return not (hasattr(torch.version, "git_version") and os.getenv("MAST_HPC_JOB_NAME") is None)


_AOT_GRAPH_COMPILE = "torch._functorch._aot_autograd.graph_compile"


def unprinted_joint_compile(joint: Any) -> bool:
    """Stop AOTAutograd printing the graphs of ``joint``'s compile (``enable_log=False`` on
    its ``AOTConfig``) when nothing would read the text; returns whether it did.

    Why: ``aot_stage2_compile`` builds the joint, forward and backward graphs' full text
    (``print_readable``) whether or not any log or trace takes it, for the AOTAutograd cache
    entry, which an export-route compile (``precompile``'s first compilation) never writes.
    At 8 layers of the model kit that is 0.3-0.5 s of each cold ``precompile``. The text is
    still made when ``TORCH_TRACE`` is on or ``TORCH_LOGS`` asks for ``aot_graphs`` /
    ``aot_joint_graph``: the first compilation's graphs stay in tlparse and in the logs.
    Only logging reads ``enable_log``; a torch without the field is left as it is."""
    if structured_tracing() or _aot_graph_logs_on():
        return False
    state = getattr(joint, "_aot_state", None)
    config = getattr(state, "aot_config", None)
    if not hasattr(config, "enable_log"):
        return False
    state.aot_config = dataclasses.replace(config, enable_log=False)  # type: ignore[union-attr,type-var]
    return True


def _aot_graph_logs_on() -> bool:
    """Does ``TORCH_LOGS`` ask for AOTAutograd's graphs (``aot_graphs``, ``aot_joint_graph``)?
    A torch whose loggers are not where this looks counts as yes: its text is left alone."""
    try:
        module = SUPPORT.module(_AOT_GRAPH_COMPILE)
    except UnsupportedTorchError:
        return True
    loggers = [getattr(module, name, None) for name in ("aot_joint_log", "aot_graphs_log")]
    return any(
        not isinstance(logger, logging.Logger) or logger.isEnabledFor(logging.INFO)
        for logger in loggers
    )


# --------------------------------------------------------------------------- collectives


def load_functional_collectives() -> None:
    """Make ``torch.ops._c10d_functional.{all_gather_into_tensor,all_to_all_single,wait_tensor}``
    usable.

    Importing ``torch.distributed._functional_collectives`` registers the ops' autograd (the
    backward of an all-gather is a reduce-scatter of the gradient, that of an all-to-all the
    all-to-all with the split sizes swapped). Called when a sharded model is built, never
    inside traced code.
    """
    SUPPORT.module("torch.distributed._functional_collectives")
    ns: Any = torch.ops._c10d_functional
    for name in ("all_gather_into_tensor", "all_to_all_single", "wait_tensor"):
        try:
            getattr(ns, name)
        except (AttributeError, RuntimeError) as exc:
            raise SUPPORT.missing(f"torch.ops._c10d_functional.{name}") from exc


def all_gather_wait(shard: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    """``wait_tensor(all_gather_into_tensor(shard, world_size, group_name))``: the FSDP
    all-gather chain, as plain op calls so Dynamo traces it into the graph (checked by
    :func:`load_functional_collectives` beforehand)."""
    ns: Any = torch.ops._c10d_functional
    full: torch.Tensor = ns.wait_tensor(ns.all_gather_into_tensor(shard, world_size, group_name))
    return full


def all_to_all_wait(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group_name: str
) -> torch.Tensor:
    """``wait_tensor(all_to_all_single(x, output_splits, input_splits, group_name))``: the EP
    token exchange as torchtitan's ``AllToAllTokenDispatcher`` issues it under compile (split
    sizes may be unbacked SymInts read with ``.tolist()``); autograd runs the exchange back with
    the splits swapped (checked by :func:`load_functional_collectives` beforehand)."""
    ns: Any = torch.ops._c10d_functional
    out: torch.Tensor = ns.wait_tensor(
        ns.all_to_all_single(x, output_splits, input_splits, group_name)
    )
    return out


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)``: rows ``offs[i-1]:offs[i]`` of the 2-D ``a`` times
    the 3-D ``b[i]`` (one group per local expert; ``offs`` int32 cumulative row counts), the
    op torchtitan's ``GroupedExperts`` uses (CPU fp32 included; checked by
    :func:`require_grouped_mm` beforehand)."""
    out: torch.Tensor = torch._grouped_mm(a, b, offs=offs)
    return out


def require_grouped_mm() -> None:
    """Raise :class:`UnsupportedTorchError` unless this torch has ``torch._grouped_mm`` (checked
    when an expert-parallel model is built, so :func:`grouped_mm` itself is a plain call that
    Dynamo traces)."""
    SUPPORT.attr("torch", "_grouped_mm")


# --------------------------------------------------------------------------- random ops


def _rng_rule_like_2_14() -> Callable[[], None]:
    mod: Any = SUPPORT.attrs(
        "torch._functorch.partitioners", ("has_recomputable_rng_ops", "must_recompute")
    )
    if hasattr(mod, "is_rng_op"):  # 2.14+: torch already decides this way
        return lambda: None
    old = mod.has_recomputable_rng_ops
    must_recompute = mod.must_recompute

    def has_recomputable_rng_ops(fx_g: torch.fx.GraphModule) -> bool:
        return any(must_recompute(n) and is_rng_op(n) for n in fx_g.graph.nodes)

    mod.has_recomputable_rng_ops = has_recomputable_rng_ops

    def undo() -> None:
        mod.has_recomputable_rng_ops = old

    return undo


#: While held, ``default_partition`` on a torch without ``partitioners.is_rng_op`` (2.11-2.13)
#: decides "does the graph recompute a random op?" as 2.14+ does. Why: there, an AC-recomputed
#: zero-dropout SDPA counts as random, so ``functionalize_rng_ops`` wraps it in
#: ``run_and_save_rng_state``, and the second compile, retracing the first compilation's
#: forward under ``FunctionalTensorMode``, fails: no torch registers a functionalization rule
#: for that HOP. With the 2.14 rule (``ap_tags.graph.is_rng_op``, which carries it) the SDPA is
#: recomputed as the deterministic op it is. A graph that recomputes a real random op keeps
#: torch's behaviour. On 2.14+ a no-op.
FIRST_PARTITION_RNG_RULE = ScopedPatch(
    "partitioners.has_recomputable_rng_ops = the 2.14 is_rng_op rule", _rng_rule_like_2_14
)


# --------------------------------------------------------------------------- backward metadata

_GRAPH_CAPTURE = "torch._functorch._aot_autograd.graph_capture"
_METADATA_COPY = "copy_fwd_metadata_to_bw_nodes"


def metadata_copy_replaces_custom(copy: Callable[[torch.fx.GraphModule], None]) -> bool:
    """Whether AOTAutograd's forward-to-backward metadata copy ``copy`` *replaces* a backward
    node's ``custom`` dict with its forward node's (torch 2.11) instead of merging the forward's
    keys over it (2.15). Decided by running it on a two-node graph, not by version: a forward
    node and a backward node (``partitioner_tag == "is_backward"``) sharing one ``seq_nr``, each
    with a ``custom`` key of its own; the backward one keeps its key only where ``copy`` merges."""
    graph = torch.fx.Graph()
    forward = graph.placeholder("x")
    forward.meta.update(seq_nr=0, custom={"forward_key": 1})
    backward = graph.call_function(torch.neg, (forward,))
    backward.meta.update(seq_nr=0, partitioner_tag="is_backward", custom={"backward_key": 1})
    graph.output(backward)
    copy(torch.fx.GraphModule(torch.nn.Module(), graph))
    custom = backward.meta.get("custom")
    return not (isinstance(custom, dict) and "backward_key" in custom)


def _merge_backward_custom_like_2_15() -> Callable[[], None]:
    try:
        mod: Any = SUPPORT.attrs(_GRAPH_CAPTURE, (_METADATA_COPY,))
    except UnsupportedTorchError:  # a torch without this copy has nothing to merge
        return lambda: None
    old = getattr(mod, _METADATA_COPY)
    try:
        replaces = metadata_copy_replaces_custom(old)
    except Exception:  # a copy that refuses the probe graph: leave torch's as it is
        log.debug("%s: probe failed; torch's copy left as it is", _METADATA_COPY, exc_info=True)
        replaces = False
    if not replaces:  # 2.15: torch already merges
        return lambda: None

    def copy_merging(fx_g: torch.fx.GraphModule) -> None:
        own = {
            node: node.meta["custom"]
            for sub in fx_g.modules()
            if isinstance(sub, torch.fx.GraphModule)
            for node in sub.graph.nodes
            if isinstance(node.meta.get("custom"), dict)
        }
        old(fx_g)
        for node, custom in own.items():
            copied = node.meta.get("custom")
            if isinstance(copied, dict) and copied is not custom:
                node.meta["custom"] = {**custom, **copied}

    setattr(mod, _METADATA_COPY, copy_merging)

    def undo() -> None:
        setattr(mod, _METADATA_COPY, old)

    return undo


#: While held, AOTAutograd's forward-to-backward metadata copy keeps a backward node's own
#: ``custom`` keys under the forward node's (torch 2.15's merge) on a torch whose copy replaces
#: the whole dict (2.11). Why: in the second compilation the retraced first compilation is one
#: autograd op, so every backward node gets the ``custom`` of its first forward op; a replacing
#: copy drops the FQN the first compilation stamped on each backward node
#: (``ap_epchunk.tag_backward_module_fqns``), and ap-bucketing then saw the whole backward as the
#: block ``tok_embeddings``: one bucket of every re-gather and one of every gradient
#: (torch 2.11, H200: 6.07 GiB peak against 5.19 unbucketed). Where torch merges, a no-op.
BACKWARD_CUSTOM_MERGE = ScopedPatch(
    "graph_capture.copy_fwd_metadata_to_bw_nodes merges custom (2.15)",
    _merge_backward_custom_like_2_15,
)


def inductor_has_option(dotted: str) -> bool:
    """``torch._inductor.config`` has the option ``dotted`` (``"aten_distributed_optimizations.
    compute_estimator"``: 2.12+; 2.11's overlap scheduler has no compute estimator choice)."""
    node: Any = SUPPORT.module(_INDUCTOR_CONFIG)
    for part in dotted.split("."):
        if not hasattr(node, part):
            return False
        node = getattr(node, part)
    return True


# --------------------------------------------------------------------------- AOTAutograd's cache

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


def marked_cacheable_functions() -> dict[str, str]:
    """``torch._inductor.config.unsafe_marked_cacheable_functions``: function name -> the
    string AOTAutograd's cache key carries for it (the config is part of the key)."""
    config: Any = SUPPORT.attrs(_INDUCTOR_CONFIG, ("unsafe_marked_cacheable_functions",))
    return dict(config.unsafe_marked_cacheable_functions)


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
