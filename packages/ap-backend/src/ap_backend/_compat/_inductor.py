"""Inductor's and AOTAutograd's entry points, the partitioner hooks and torch's partitioners,
Inductor's joint-graph passes and decompositions.

Part of the compat seam (:mod:`ap_backend._compat`): every private torch name is looked up
at call time through ``SUPPORT``."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ._config import inductor_config_patch
from ._support import SUPPORT

_COMPILE_FX = "torch._inductor.compile_fx"
_CUSTOM_GRAPH_PASS = "torch._inductor.custom_graph_pass"

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
    """:func:`hash_files` over every ``*.py`` under each package's directory, subpackages
    included (this seam is one): what changes when the code of a pass (or of what a cache key
    stands for) changes."""
    files = tuple(
        sorted(str(f) for pkg in packages for f in Path(str(pkg.__file__)).parent.rglob("*.py"))
    )
    return hash_files(files)


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
