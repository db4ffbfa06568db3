"""One all-gather per weight in a backward graph: a recomputation's re-gathers merged into one.

Why: dropping a saved value for an activation budget makes the backward recompute the value's
closure, and a closure that reads an FSDP-gathered weight re-runs that weight's
``MUST_RECOMPUTE`` gather chain (cast, ``all_gather_into_tensor``, ``wait_tensor``, views). The
backward already gathers the same weight for its own gradient matmuls (the first compilation's
re-gathers), and extraction copies both chains: on the model kit (2 layers, half the replay's
saved bytes) the backward gathered 9 of its 21 weights twice, 30 all-gathers where 21 do, each
one a weight's full unsharded bytes on the wire and in memory.

Two chains that apply the same ops to the same shard over the same group compute the same value,
so the later one's readers can read the earlier one's. Every rank runs the same graph through
the same merge, so a collective dropped here is dropped on every rank: the ranks' collective
sequences stay matched. What is merged is exactly such a chain, from a graph input through the
ops in :func:`_chain_ops` (the ones an FSDP chain is made of: casts, the gather, its wait,
views), and only where it reaches an all-gather; nothing else is deduplicated. After the merge
the extraction's order still holds (the earlier chain precedes every reader), and the
autograd-order epilogue then places the one chain right before its first reader.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from ap_partitioner import _compat

__all__ = ["merge_repeated_gathers"]


@functools.cache
def _chain_ops() -> frozenset[Any]:
    """The ops an FSDP gather chain is made of (all pure; the wait is the gather's own)."""
    aten, prims = torch.ops.aten, torch.ops.prims
    ops: set[Any] = {
        prims.convert_element_type.default,
        aten._to_copy.default,
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.t.default,
        aten.permute.default,
        aten.transpose.int,
        aten.split_with_sizes.default,
        aten.split.Tensor,
        aten.slice.Tensor,
        aten.contiguous.default,
        aten.clone.default,
        operator.getitem,
    }
    collectives = {
        _compat.c10d_functional_op("all_gather_into_tensor"),
        _compat.c10d_functional_op("wait_tensor"),
    }
    return frozenset(ops | (collectives - {None}))


def _frozen(value: Any, keys: Mapping[fx.Node, tuple[Any, ...]]) -> Any:
    """``value`` (an argument) with every node replaced by its key; ``None`` when a node has
    none (it is not a chain value) or a constant is unhashable."""
    if isinstance(value, fx.Node):
        return keys.get(value)
    if isinstance(value, (list, tuple)):
        items = tuple(_frozen(v, keys) for v in value)
        if any(i is None and v is not None for i, v in zip(items, value, strict=True)):
            return None
        return (type(value).__name__, items)
    try:
        hash(value)
    except TypeError:
        return None
    return ("const", type(value).__name__, value)


def _key(node: fx.Node, keys: Mapping[fx.Node, tuple[Any, ...]]) -> tuple[Any, ...] | None:
    """What ``node`` computes, if its inputs are chain values: its op and its arguments."""
    args = _frozen(node.args, keys)
    kwargs = tuple((name, _frozen(v, keys)) for name, v in sorted(node.kwargs.items()))
    if args is None or any(k is None and node.kwargs[n] is not None for n, k in kwargs):
        return None
    return (node.target, args, kwargs)


def merge_repeated_gathers(graph: fx.Graph) -> list[str]:
    """Merge every gather chain of ``graph`` that repeats an earlier one (same input, same ops,
    same arguments) into the earlier one, and erase the nodes only the repeats read. Returns
    the names of the all-gathers removed, in graph order (empty: the graph is unchanged)."""
    gather = _compat.c10d_functional_op("all_gather_into_tensor")
    chain_ops = _chain_ops()
    if gather is None:
        return []
    keys: dict[fx.Node, tuple[Any, ...]] = {}
    gathered: set[fx.Node] = set()  # chain nodes at or after an all-gather
    first: dict[tuple[Any, ...], fx.Node] = {}
    repeats: list[fx.Node] = []
    for node in graph.nodes:
        if node.op == "placeholder":
            keys[node] = ("input", node.name)
            continue
        if node.op != "call_function" or node.target not in chain_ops:
            continue
        key = _key(node, keys)
        if key is None:
            continue
        keys[node] = key
        if node.target is gather or any(i in gathered for i in node.all_input_nodes):
            gathered.add(node)
        earlier = first.setdefault(key, node)
        if earlier is not node and node in gathered:
            node.replace_all_uses_with(earlier)
            repeats.append(node)
    removed = [n.name for n in repeats if n.target is gather]
    # erase the repeats, then whatever chain node only they read (the repeat's own cast)
    dead = list(reversed(repeats))
    while dead:
        node = dead.pop(0)
        if node.users or node not in keys:  # read by a kept node, or erased already
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        keys.pop(node)
        dead += [i for i in inputs if i.op == "call_function" and i in keys and not i.users]
    return removed
