"""Every private torch name ap-partitioner uses, looked up at call time and feature-detected.

See :mod:`ap_tags.torch_support` for the convention all ap packages follow. A torch release that
moves one of these internals fails with this package's :class:`UnsupportedTorchError` naming the
internal and the tested torch versions, instead of an ``AttributeError`` deep inside a compile.
Version differences (2.15's ``wait_tensors``, 2.14's
``is_rng_op``) are decided by feature detection, never by version strings.

The one exception to "looked up at call time" is :data:`CustomPartitionerFn`, the base class of
the partitioners, which is needed when their classes are defined.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from ap_tags import torch_support
from ap_tags.graph import is_rng_op, op_overload

#: The torch versions ap-partitioner is tested on (the only place they are written).
TESTED_TORCH = ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0")


class UnsupportedTorchError(torch_support.UnsupportedTorchError):
    """A torch internal ap-partitioner relies on is missing from the installed torch."""


SUPPORT = torch_support.TorchSupport("ap-partitioner", TESTED_TORCH, UnsupportedTorchError)

#: Names ``torch._functorch.partitioners`` must provide (present in 2.11.0 through 2.15.0).
#: ``_is_assert_only_symbool`` and ``is_opaque_node`` (2.13+) are not among them: where torch
#: lacks them this module carries their 2.15 definitions (:func:`is_assert_only_symbool`,
#: :func:`is_opaque_node`).
_PARTITIONERS = "torch._functorch.partitioners"
_PARTITIONER_NAMES = (
    "_extract_fwd_bwd_modules",
    "_extract_fwd_bwd_outputs",
    "_has_tag_is_backward",
    "_is_backward_state",
    "_is_bwd_seed_offset",
    "_is_tangent",
    "_must_be_in_forward",
    "classify_nodes",
    "cleanup_recompute_tags",
    "default_partition",
    "force_save_bw_mutation_src",
    "force_save_collectives",
    "force_save_effectful_ops",
    "functionalize_rng_ops",
    "has_recomputable_ops",
    "has_recomputable_rng_ops",
    "is_sym_node",
    "min_cut_rematerialization_partition",
    "must_recompute",
    "thread_graphsafe_rng_from_hops",
)


# --------------------------------------------------------------------------- partitioner base


class _PartitionerBase:
    """Stand-in base class for a torch without ``CustomPartitionerFn`` (none of the tested
    ones): the partitioners still work as an AOTAutograd ``partition_fn``."""

    def __call__(
        self, gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        raise NotImplementedError

    def uuid(self) -> Any:
        raise NotImplementedError


def _partitioner_base() -> type:
    try:
        base: type = SUPPORT.attr("torch._inductor.custom_graph_pass", "CustomPartitionerFn")
    except UnsupportedTorchError:
        return _PartitionerBase
    return base


if TYPE_CHECKING:
    from torch._inductor.custom_graph_pass import CustomPartitionerFn as CustomPartitionerFn
else:
    #: ``torch._inductor.custom_graph_pass.CustomPartitionerFn``: what Inductor's
    #: ``custom_partitioner_fn`` must be an instance of.
    CustomPartitionerFn = _partitioner_base()


# --------------------------------------------------------------------------- partitioners


def partitioners() -> ModuleType:
    """``torch._functorch.partitioners``, checked for every name the partitioner uses.

    Looked up at call time (not import time) so tests may monkeypatch torch's module.
    """
    return SUPPORT.attrs(_PARTITIONERS, _PARTITIONER_NAMES)


def is_assert_only_symbool(node: fx.Node) -> bool:
    """A SymBool node whose every user is ``aten._assert_scalar`` (never saved: the backward
    needs no runtime assert). torch's ``partitioners._is_assert_only_symbool`` where it exists
    (2.13+); otherwise its torch 2.15 definition (``torch/_functorch/partitioners.py``)."""
    rule = getattr(SUPPORT.module(_PARTITIONERS), "_is_assert_only_symbool", None)
    if rule is not None:
        return bool(rule(node))
    return (
        isinstance(node.meta.get("val"), torch.SymBool)
        and len(node.users) > 0
        and all(user.target is torch.ops.aten._assert_scalar.default for user in node.users)
    )


def is_opaque_node(node: Any) -> bool:
    """A node holding an opaque, non-tensor value (a process group, a script object).

    torch's ``partitioners.is_opaque_node`` where it exists (2.12+); otherwise its torch 2.15
    definition (``torch/_functorch/_aot_autograd/graph_compile.py``), with 2.11's name for the
    custom-class test (``opaque_object.is_opaque_value``; 2.15 calls it
    ``is_custom_class_obj``)."""
    rule = getattr(SUPPORT.module(_PARTITIONERS), "is_opaque_node", None)
    if rule is not None:
        return bool(rule(node))
    if not isinstance(node, fx.Node) or "val" not in node.meta:
        return False
    val = node.meta["val"]
    fake_script_object = SUPPORT.attr("torch._library.fake_class_registry", "FakeScriptObject")
    if isinstance(val, torch.ScriptObject | fake_script_object):
        return True
    opaque = SUPPORT.module("torch._library.opaque_object")
    custom = getattr(opaque, "is_custom_class_obj", None) or getattr(
        opaque, "is_opaque_value", None
    )
    return bool(custom is not None and custom(val))


def extract_fwd_bwd_modules(
    joint: fx.GraphModule,
    saved_values: list[fx.Node],
    saved_sym_nodes: list[fx.Node],
    saved_opaque_nodes: list[fx.Node],
    **kwargs: Any,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """torch's ``partitioners._extract_fwd_bwd_modules``; ``saved_sym_nodes`` is mutated to
    the symbols actually saved, as torch does.

    2.12+ take the opaque values as ``saved_opaque_nodes``; 2.11 has no such parameter and
    separates the ``FakeScriptObject`` values it finds among ``saved_values`` itself (placing
    them after the tensors, as 2.12+ do), so there they are passed as saved values."""
    extract = partitioners()._extract_fwd_bwd_modules
    if "saved_opaque_nodes" in inspect.signature(extract).parameters:
        kwargs["saved_opaque_nodes"] = saved_opaque_nodes
    else:
        saved_values = [*saved_values, *saved_opaque_nodes]
    fw, bw = extract(joint, saved_values, saved_sym_nodes=saved_sym_nodes, **kwargs)
    return fw, bw


def functorch_config() -> Any:
    """``torch._functorch.config``: ``unsafe_allow_optimization_of_collectives`` decides
    whether torch's prologue pins collectives, so the replay's prologue reads it too."""
    return SUPPORT.module("torch._functorch.config")


def is_with_effects(node: fx.Node) -> bool:
    """True for a ``with_effects`` node (an effectful op threaded through a token)."""
    check = SUPPORT.attr("torch._functorch._aot_autograd.utils", "is_with_effects")
    return bool(check(node))


# --------------------------------------------------------------------------- graph modules


def deferred_codegen_module(
    root: fx.GraphModule, graph: fx.Graph, class_name: str
) -> fx.GraphModule:
    """A GraphModule over ``graph`` whose Python code is generated on first use, not now.

    The partitioner's working joint module is never run: torch's prologue and extraction only
    read its graph, yet an eager ``GraphModule`` regenerates and ``exec``s its code on
    construction and on every ``graph`` assignment (seconds on large joints). torch's own
    ``_LazyGraphModule`` defers that; where it is missing we fall back to an eager module.
    """
    try:
        lazy = SUPPORT.attr("torch.fx._lazy_graph_module", "_LazyGraphModule")
    except UnsupportedTorchError:  # pragma: no cover - present in every tested torch
        return fx.GraphModule(root, graph, class_name)
    module: fx.GraphModule = lazy(root, graph, class_name)
    return module


def copy_codegen(source: fx.Graph, target: fx.Graph) -> None:
    """Give ``target`` the code generator of ``source`` (``Graph._codegen``: how inputs and
    outputs are flattened), so a node-by-node copy generates the same calling convention."""
    target.set_codegen(source._codegen)


# --------------------------------------------------------------------------- side effects


def wait_ops() -> tuple[Any, ...]:
    """The functional-collective wait ops (packets and overloads) this torch registers.

    ``wait_tensor`` exists in every supported version; ``wait_tensors`` is new in 2.15.
    Importing ``_functional_collectives`` first is what registers them as side-effectful.
    """
    if not torch.distributed.is_available():
        return ()
    SUPPORT.module("torch.distributed._functional_collectives")
    ns = torch.ops._c10d_functional
    found: list[Any] = []
    for name in ("wait_tensor", "wait_tensors"):
        if hasattr(ns, name):
            packet = getattr(ns, name)
            found.extend((packet, packet.default))
    return tuple(found)


def c10d_functional_op(name: str) -> Any:
    """``_c10d_functional.<name>.default``, or ``None`` on a torch built without distributed or
    without that op (the gather merge then has nothing to merge)."""
    if not torch.distributed.is_available():
        return None
    packet = getattr(torch.ops._c10d_functional, name, None)
    return getattr(packet, "default", None)


def side_effect_registry() -> set[Any]:
    """``torch.fx.node._side_effectful_functions``: the ops ``Node.is_impure`` keeps alive.

    2.13-2.15 all consult it (through ``torch._library.utils.is_impure``, which checks both the
    packet and the overload); it must be a set for its registrations to be removed and restored.
    """
    registry = getattr(SUPPORT.module("torch.fx.node"), "_side_effectful_functions", None)
    if not isinstance(registry, set):
        raise SUPPORT.missing("torch.fx.node._side_effectful_functions (a set)")
    return registry


# --------------------------------------------------------------------------- logging


def trace_artifact(name: str, payload_fn: Callable[[], str]) -> None:
    """Emit a JSON ``trace_structured`` artifact (``torch._logging``), shown by ``tlparse``."""
    trace_structured = SUPPORT.attr("torch._logging", "trace_structured")
    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "json"},
        payload_fn=payload_fn,
    )


# --------------------------------------------------------------------------- random ops


def no_fake_mode() -> Any:
    """A context without the active fake mode (``unset_fake_temporarily``): the budget's FLOP
    formulas build plain meta tensors, which inside a compile would otherwise be fakified."""
    return SUPPORT.attr("torch._subclasses.fake_tensor", "unset_fake_temporarily")()


def flop_formula(op: Any) -> Any | None:
    """``torch.utils.flop_counter``'s FLOP formula for ``op``'s packet (called with the op's
    arguments and ``out_val=``; tensors are read for their shapes), or None for an op it does
    not count."""
    registry = SUPPORT.attr("torch.utils.flop_counter", "flop_registry")
    packet = getattr(op, "overloadpacket", op)
    return registry.get(packet)


def is_random(node: fx.Node) -> bool:
    """An op whose recomputation would draw different random numbers.

    Decided as torch's partitioners decide it (:func:`ap_tags.graph.is_rng_op`: their
    ``is_rng_op``, 2.14+, or its 2.14 rule on an older torch): the ``nondeterministic_seeded``
    tag, except for SDPA-family ops whose ``dropout_p`` is known to be 0 -- the tag is on the op
    (it *may* use dropout), but with no dropout flash attention is deterministic and torch
    recomputes it freely (the first compilation's backward may do so). A higher-order op counts
    when it carries ``_nondeterministic_seeded``.
    """
    if node.op != "call_function":
        return False
    if op_overload(node) is None:  # (an OpOverload mirrors its tags here)
        return bool(getattr(node.target, "_nondeterministic_seeded", False))
    return is_rng_op(node)  # torch's rule, carried from 2.14 where torch lacks it (ap-tags)
