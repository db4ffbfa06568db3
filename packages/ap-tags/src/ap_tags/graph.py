"""The graph vocabulary every ap pass shares: what a node *is* and what it *costs*.

Each predicate and measure here is defined once and used by ap-tags, ap-partitioner,
ap-epchunk and ap-backend, so two passes can never disagree about, say, whether a saved value
is an unsharded weight (``is_all_gather_output``) or how many bytes it keeps alive
(``storage_nbytes``). ap-bucketing depends on torch only and keeps the three it needs; a
cross-package test checks its copies against these on the same graphs.

Design rules:

* Predicates read only ``node.op``, ``node.target``, ``node.args`` and ``node.meta``; they never
  guard on symbolic sizes and never mutate anything.
* Sizes use optimization hints (``size_hint``): a symbolic extent with a hint is sized by the
  hint, one without a hint is *unknown* (``None``), never guessed.
* "Storage" is what a value keeps alive: a view, ``_unsafe_view``, ``detach`` or ``alias`` of a
  tensor shares its base's storage, so saving it costs the base's bytes, once.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx

from . import _compat
from .checks import require_graph, require_graph_module, require_node

__all__ = [
    "BACKWARD_PARTITIONER_TAGS",
    "COLLECTIVE_NAMESPACE",
    "activation_storages",
    "aliases_input",
    "backward_nodes",
    "collective_input",
    "is_all_gather",
    "is_all_gather_output",
    "is_backward_node",
    "is_pass_created",
    "is_collective",
    "is_getitem",
    "is_multi_output",
    "is_reduce_scatter",
    "is_rng_op",
    "is_tangent",
    "is_wait",
    "node_nbytes",
    "op_overload",
    "saved_for_backward",
    "size_hint",
    "storage_base",
    "storage_nbytes",
    "tensor_nbytes",
]

#: Namespace of torch's functional collectives (``torch.ops._c10d_functional``).
COLLECTIVE_NAMESPACE = "_c10d_functional"
#: ``meta["partitioner_tag"]`` values AOTAutograd writes on backward nodes.
BACKWARD_PARTITIONER_TAGS = ("is_backward", "must_be_in_backward")
#: AOTAutograd's forward ``partitioner_tag`` values (every node traced in a joint's forward).
FORWARD_PARTITIONER_TAGS = ("is_forward", "must_be_in_forward")

_WAITS = ("wait_tensor", "wait_tensors")
_ALL_GATHERS = (
    "all_gather_into_tensor",
    "all_gather_into_tensor_out",
    "all_gather_into_tensor_coalesced",
)
_REDUCE_SCATTERS = ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced")


# --------------------------------------------------------------------------- op identity


def op_overload(node: torch.fx.Node) -> Any | None:
    """The ``torch._ops.OpOverload`` a ``call_function`` node calls, else None."""
    if node.op != "call_function":
        return None
    target = node.target
    return target if isinstance(target, _compat.op_overload_type()) else None


def _collective_name(node: torch.fx.Node) -> str | None:
    """``"all_gather_into_tensor"`` for ``_c10d_functional.all_gather_into_tensor.default``;
    None for anything outside the functional-collective namespace."""
    op = op_overload(node)
    if op is None or op.namespace != COLLECTIVE_NAMESPACE:
        return None
    name: str = op._schema.name.split("::", 1)[-1]
    return name


def is_getitem(node: torch.fx.Node) -> bool:
    """``operator.getitem`` on a node: how FX projects one output of a multi-output op."""
    return node.op == "call_function" and node.target is operator.getitem


def is_multi_output(node: torch.fx.Node) -> bool:
    """A node whose value is a tuple/list of outputs (read through getitems).

    ``meta["val"]`` decides when present; hand-built graphs without it count as multi-output
    when every user is a getitem.
    """
    val = node.meta.get("val")
    if isinstance(val, tuple | list):
        return True
    return bool(node.users) and all(is_getitem(u) for u in node.users)


def is_wait(node: torch.fx.Node) -> bool:
    """``wait_tensor`` (every supported torch) or ``wait_tensors`` (2.15+)."""
    return _collective_name(node) in _WAITS


def is_collective(node: torch.fx.Node) -> bool:
    """A functional collective that communicates (every ``_c10d_functional`` op but the waits).

    Why waits are excluded: a wait moves no data; recomputing or counting it is never what a
    caller asking "does this re-run communication?" means.
    """
    name = _collective_name(node)
    return name is not None and name not in _WAITS


def is_all_gather(node: torch.fx.Node) -> bool:
    """An all-gather (plain, ``_out`` or coalesced variant)."""
    return _collective_name(node) in _ALL_GATHERS


def is_reduce_scatter(node: torch.fx.Node) -> bool:
    """A reduce-scatter (plain or coalesced variant)."""
    return _collective_name(node) in _REDUCE_SCATTERS


def collective_input(wait: torch.fx.Node, index: int = 0) -> torch.fx.Node | None:
    """The collective a wait waits on: ``wait_tensor(c)`` -> ``c``; ``wait_tensors([a, b])``
    -> the ``index``-th entry. None when the argument is not a node."""
    if not wait.args:
        return None
    arg = wait.args[0]
    if isinstance(arg, list | tuple):
        arg = arg[index] if 0 <= index < len(arg) else None
    return arg if isinstance(arg, torch.fx.Node) else None


# --------------------------------------------------------------------------- storage


def aliases_input(node: torch.fx.Node) -> bool:
    """The op's output shares its first input's storage: every op whose schema says so (views
    such as ``view``, ``t``, ``slice``, ``expand``, ``detach``, ``alias``, and ``reshape``, which
    may alias) plus ``_unsafe_view`` (a view autograd does not track as one). Where such an op
    copies instead, the copy has the same size, so sizes and "is this an unsharded weight?"
    come out the same either way."""
    op = op_overload(node)
    if op is None:
        return False
    return bool(op.is_view) or op is torch.ops.aten._unsafe_view.default


def storage_base(node: torch.fx.Node) -> torch.fx.Node:
    """The node that owns the storage ``node``'s value lives in (``node`` itself when it is not
    an alias). Saving a view keeps its base alive, so saved sets are counted and sized by base.
    A ``getitem`` stands for one output of a multi-output op: its own storage, unless the op's
    schema says its outputs alias its input (``split``, ``unbind``, ``chunk``), where it is a
    view of that input like any other."""
    current = node
    for _ in range(256):  # alias chains are short; the bound only guards malformed graphs
        if is_getitem(current) and isinstance(current.args[0], torch.fx.Node):
            if aliases_input(current.args[0]):
                current = current.args[0]
                continue
            break
        source = current.args[0] if current.args else None
        if not aliases_input(current) or not isinstance(source, torch.fx.Node):
            break
        current = source
    return current


def _gathered(node: torch.fx.Node | None) -> bool:
    """``node`` is an all-gather's result: the op itself, or one output of a coalesced one."""
    if node is None:
        return False
    if is_getitem(node) and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return is_all_gather(node)


def is_all_gather_output(node: torch.fx.Node) -> bool:
    """The value's storage is an all-gather's result: an all-gather, its wait (``wait_tensor``,
    or a ``getitem`` of ``wait_tensors``), or any view of those. Keeping one alive for backward
    keeps a whole unsharded weight alive, which is what resharding after forward forbids."""
    require_node(node, where="is_all_gather_output")
    base = storage_base(node)
    if _gathered(base):
        return True
    if is_wait(base):
        return _gathered(collective_input(base))
    parent = base.args[0] if is_getitem(base) else None
    if isinstance(parent, torch.fx.Node) and is_wait(parent):
        index = base.args[1]
        return isinstance(index, int) and _gathered(collective_input(parent, index))
    return False


# --------------------------------------------------------------------------- direction


def is_tangent(node: torch.fx.Node) -> bool:
    """A joint graph's gradient input (AOTAutograd names them ``tangents_<i>``)."""
    return node.op == "placeholder" and str(node.target).startswith("tangents")


def is_backward_node(node: torch.fx.Node) -> bool:
    """A node AOTAutograd (or ``ap_epchunk.trace_joint``) marked as part of the backward:
    ``meta["autograd_backward"]`` or a backward ``partitioner_tag``.

    ``seq_nr`` alone never decides direction: a forward op and the backward ops that
    differentiate it share one.
    """
    return (
        node.meta.get("autograd_backward", False) is True
        or node.meta.get("partitioner_tag") in BACKWARD_PARTITIONER_TAGS
    )


def backward_nodes(graph: torch.fx.Graph | torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Every node of a joint graph that runs in the backward: the tangents, the nodes marked
    backward, and everything computed from either (the output node excluded).

    Reachability matters because marks are incomplete: a gradient accumulation ``add`` or a
    tangent ``expand`` may carry no backward mark, yet reads a tangent. So are the nodes a
    joint-graph pass created for the backward (:func:`is_pass_created`) without reading a
    tangent: they belong to the backward when every user does.
    """
    g = require_graph(graph, where="backward_nodes")
    seen: set[torch.fx.Node] = set()
    stack = [n for n in g.nodes if is_tangent(n) or is_backward_node(n)]
    while stack:
        node = stack.pop()
        if node in seen or node.op == "output":
            continue
        seen.add(node)
        stack.extend(node.users)
    if any(n.meta.get("partitioner_tag") in FORWARD_PARTITIONER_TAGS for n in g.nodes):
        for node in reversed(g.nodes):
            if node not in seen and is_pass_created(node) and node.users:
                if all(user in seen for user in node.users):
                    seen.add(node)
    return seen


def is_pass_created(node: torch.fx.Node) -> bool:
    """An op of an AOTAutograd joint graph that no trace created: it carries neither the
    ``partitioner_tag`` AOTAutograd stamps on every forward node once the forward is traced,
    nor the backward mark of a node traced while autograd ran.

    Why it matters: Inductor's joint-graph passes run before partitioning and replace ops with
    new, untagged nodes (``scatter`` over a constant into ``iota`` / ``eq`` / ``where``: the
    cross-entropy backward's one-hot). Only the replacement's output copies the replaced
    node's meta; its interior is unmarked, so direction by marks alone put it in the forward,
    and a save-all replay then saved the ``eq`` one-hot mask the backward reads (``[N, V]``
    bools) instead of the ``[N]`` int64 targets the first partition saved. Only meaningful on
    a graph that carries AOTAutograd's forward stamps (``backward_nodes`` checks).
    """
    return (
        node.op == "call_function"
        and "partitioner_tag" not in node.meta
        and "autograd_backward" not in node.meta
    )


# --------------------------------------------------------------------------- random ops


def is_rng_op(node: torch.fx.Node) -> bool:
    """Running the op again would draw other random numbers, as torch's partitioners decide it:
    their own ``is_rng_op`` where torch has it (2.14+); on an older torch (2.11-2.13) its 2.14
    rule, cited from torch 2.15 ``torch/_functorch/partitioners.py`` (``is_rng_op``,
    ``is_nonzero_dropout_sdpa``): an op tagged ``nondeterministic_seeded``, except one with a
    ``dropout_p`` argument that is the literal 0. The tag is on the SDPA family because it *may*
    use dropout; without it, flash attention is deterministic and recomputable.

    The one definition of this rule in the workspace: ap-partitioner's save rules and budget,
    and ap-backend's first partition on a torch without ``is_rng_op`` decide by it."""
    torch_rule = _compat.partitioners_is_rng_op()
    if torch_rule is not None:
        return bool(torch_rule(node))
    target = op_overload(node)
    if target is None or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    return not _dropout_statically_zero(node, target)


def _dropout_statically_zero(node: torch.fx.Node, target: Any) -> bool:
    """``node`` (calling ``target``) has a ``dropout_p`` argument that is the literal 0."""
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


# --------------------------------------------------------------------------- sizes


def size_hint(value: int | torch.SymInt) -> int | None:
    """A concrete int for a (possibly symbolic) size, from hints only; None when unknown.

    Backed symbols use their value, unbacked ones the optimization hint they were marked
    with (``mark_unbacked(..., hint_override=N)``); an expression with any unhinted symbol
    is unknown. Never installs a guard.
    """
    if isinstance(value, bool):
        raise TypeError(f"size_hint: expected an int or SymInt, got bool {value!r}")
    if isinstance(value, int):
        return value
    if not isinstance(value, torch.SymInt):
        raise TypeError(f"size_hint: expected an int or SymInt, got {type(value).__name__}")
    return _compat.symint_hint(value)


def tensor_nbytes(value: object) -> int | None:
    """Bytes of a tensor's elements (``numel * itemsize``) from hints; 0 for non-tensors,
    None when a symbolic size has no hint."""
    if not isinstance(value, torch.Tensor):
        return 0
    numel = size_hint(value.numel())
    return None if numel is None else numel * value.element_size()


def node_nbytes(node: torch.fx.Node) -> int:
    """Bytes of ``node``'s own tensor value (``meta["val"]``); 0 for tuples, symbols,
    non-tensors and unhinted sizes (a tuple's tensors are counted on its getitems)."""
    return tensor_nbytes(node.meta.get("val")) or 0


def storage_nbytes(nodes: Iterable[torch.fx.Node]) -> int:
    """Bytes kept alive by ``nodes``: each distinct storage base counted once."""
    bases = dict.fromkeys(storage_base(n) for n in nodes)
    return sum(node_nbytes(b) for b in bases)


# --------------------------------------------------------------------------- saved sets


def saved_for_backward(
    fw_module: torch.fx.GraphModule, num_fwd_outputs: int
) -> list[torch.fx.Node]:
    """The values a partitioned forward hands its backward: its outputs after the first
    ``num_fwd_outputs`` (AOTAutograd's layout ``[user outputs | saved values]``), in order."""
    require_graph_module(fw_module, where="saved_for_backward", arg="fw_module")
    outputs = fw_module.graph.output_node().args[0]
    values = outputs if isinstance(outputs, list | tuple) else (outputs,)
    return [v for v in values[num_fwd_outputs:] if isinstance(v, torch.fx.Node)]


def activation_storages(values: Iterable[torch.fx.Node]) -> list[torch.fx.Node]:
    """The distinct storages a set of saved values keeps alive that are *activations*.

    This is the one definition of "what a partition saved" every report uses (the first
    partition's summary, the backend's, ap-partitioner's ``PartitionReport``): each saved tensor
    is counted by its storage base, once (saving ``rsqrt`` and ``detach(rsqrt)`` keeps one
    tensor alive); a base that is a graph input is not an activation (the caller holds the
    input anyway); symbols and opaque values are not tensors. Sized with ``storage_nbytes``.
    """
    bases: dict[torch.fx.Node, None] = {}
    for value in values:
        base = storage_base(value)
        if base.op != "placeholder" and isinstance(base.meta.get("val"), torch.Tensor):
            bases.setdefault(base)
    return list(bases)
