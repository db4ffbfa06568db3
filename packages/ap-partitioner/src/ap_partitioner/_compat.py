"""The torch internals this package touches, resolved once and feature-detected.

Every private torch name the partitioner needs is looked up here, so a torch release that moves
one fails with a message naming the missing internal and the supported range instead of an
``AttributeError`` deep inside a compile. Version differences (2.14's ``fx_graph_cse`` key,
2.15's ``wait_tensors``) are decided by feature detection, never by version strings.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import operator
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.fx as fx

SUPPORTED_TORCH = ">=2.13,<2.16"

#: Names ``torch._functorch.partitioners`` must provide (present in 2.13.0, 2.14.1 and 2.15.0).
_PARTITIONER_NAMES = (
    "_extract_fwd_bwd_modules",
    "_extract_fwd_bwd_outputs",
    "_has_tag_is_backward",
    "_is_assert_only_symbool",
    "_is_backward_state",
    "_is_bwd_seed_offset",
    "_is_primal",
    "_is_tangent",
    "_must_be_in_forward",
    "_size_of",
    "classify_nodes",
    "cleanup_recompute_tags",
    "default_partition",
    "force_save_bw_mutation_src",
    "force_save_collectives",
    "force_save_effectful_ops",
    "functionalize_rng_ops",
    "fx_graph_cse",
    "has_recomputable_ops",
    "has_recomputable_rng_ops",
    "is_opaque_node",
    "is_sym_node",
    "min_cut_rematerialization_partition",
    "must_recompute",
    "raise_getitems",
    "reordering_to_mimic_autograd_engine",
    "thread_graphsafe_rng_from_hops",
)


class UnsupportedTorchError(RuntimeError):
    """A torch internal the partitioner relies on is missing from the installed torch."""


def partitioners() -> ModuleType:
    """``torch._functorch.partitioners``, checked for every name the partitioner uses.

    Looked up at call time (not import time) so tests may monkeypatch torch's module.
    """
    from torch._functorch import partitioners as mod

    missing = [name for name in _PARTITIONER_NAMES if not hasattr(mod, name)]
    if missing:
        raise UnsupportedTorchError(
            f"ap-partitioner needs torch{SUPPORTED_TORCH}; torch {torch.__version__} lacks "
            f"torch._functorch.partitioners.{', '.join(missing)}"
        )
    return mod


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
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # pragma: no cover - present in every supported torch
        return fx.GraphModule(root, graph, class_name)
    return _LazyGraphModule(root, graph, class_name)


def is_with_effects(node: fx.Node) -> bool:
    """True for a ``with_effects`` node (an effectful op threaded through a token)."""
    from torch._functorch._aot_autograd.utils import is_with_effects as _is_with_effects

    return bool(_is_with_effects(node))


@functools.cache
def _cse_takes_node_key() -> bool:
    """2.14 added ``extra_node_key`` to ``fx_graph_cse``; 2.13 takes the graph only."""
    from torch._functorch.compile_utils import fx_graph_cse

    return "extra_node_key" in inspect.signature(fx_graph_cse).parameters


def joint_graph_cse(joint_module: fx.GraphModule, num_fwd_outputs: int) -> fx.Graph:
    """CSE the joint graph exactly as this torch's min-cut prologue does.

    From 2.14 min-cut keys CSE on "is this node a backward dependency" so a forward-only value is
    never merged with one the backward needs (which would turn it into an extra saved output);
    2.13 has no such key and merges everything.
    """
    mod = partitioners()
    graph = joint_module.graph
    if not _cse_takes_node_key():
        return mod.fx_graph_cse(graph)  # type: ignore[no-any-return]
    _, bwd_outputs, _, _ = mod._extract_fwd_bwd_outputs(
        joint_module, num_fwd_outputs=num_fwd_outputs
    )
    deps: set[fx.Node] = set()
    stack = [o for o in bwd_outputs if isinstance(o, fx.Node) and o.op != "output"]
    while stack:
        node = stack.pop()
        if node in deps:
            continue
        deps.add(node)
        stack.extend(node.all_input_nodes)
    return mod.fx_graph_cse(graph, extra_node_key=deps.__contains__)  # type: ignore[no-any-return]


def wait_ops() -> tuple[Any, ...]:
    """The functional-collective wait ops (packets and overloads) this torch registers.

    ``wait_tensor`` exists in every supported version; ``wait_tensors`` is new in 2.15.
    Importing ``_functional_collectives`` first is what registers them as side-effectful.
    """
    if not torch.distributed.is_available():
        return ()
    importlib.import_module("torch.distributed._functional_collectives")

    ns = torch.ops._c10d_functional
    found: list[Any] = []
    for name in ("wait_tensor", "wait_tensors"):
        if hasattr(ns, name):
            packet = getattr(ns, name)
            found.extend((packet, packet.default))
    return tuple(found)


def is_collective(node: fx.Node) -> bool:
    """A ``_c10d_functional`` op other than a wait (i.e. one that communicates)."""
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and target.namespace == "_c10d_functional"
        and not target.__name__.startswith("wait_tensor")
    )


def is_wait(node: fx.Node) -> bool:
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and target.namespace == "_c10d_functional"
        and target.__name__.startswith("wait_tensor")
    )


def is_all_gather(node: fx.Node) -> bool:
    target = node.target
    return (
        is_collective(node)
        and isinstance(target, torch._ops.OpOverload)
        and "all_gather" in target.__name__
    )


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def _dropout_statically_zero(node: fx.Node) -> bool:
    """An SDPA-family op whose ``dropout_p`` argument is the literal 0 (2.13 has no
    ``is_rng_op`` to ask)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    names = [arg.name for arg in target._schema.arguments]
    if "dropout_p" not in names:
        return False
    idx = names.index("dropout_p")
    if len(node.args) > idx:
        value = node.args[idx]
    elif "dropout_p" in node.kwargs:
        value = node.kwargs["dropout_p"]
    else:
        value = target._schema.arguments[idx].default_value
    return isinstance(value, int | float) and not isinstance(value, bool) and value == 0


def is_random(node: fx.Node) -> bool:
    """An op whose recomputation would draw different random numbers.

    Decided as torch's partitioners decide it (``partitioners.is_rng_op``, 2.14+): the
    ``nondeterministic_seeded`` tag, except for SDPA-family ops whose ``dropout_p`` is known to
    be 0 -- the tag is on the op (it *may* use dropout), but with no dropout flash attention is
    deterministic and torch recomputes it freely (the first compilation's backward may do so).
    """
    if node.op != "call_function":
        return False
    target: Callable[..., Any] | Any = node.target
    if not isinstance(target, torch._ops.OpOverload):  # (an OpOverload mirrors its tags here)
        return bool(getattr(target, "_nondeterministic_seeded", False))
    torch_rule = getattr(partitioners(), "is_rng_op", None)
    if torch_rule is not None:
        return bool(torch_rule(node))
    return torch.Tag.nondeterministic_seeded in target.tags and not _dropout_statically_zero(node)
