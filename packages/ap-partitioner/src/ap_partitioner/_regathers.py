"""A recomputation's re-gather of a weight merged with the backward's own gather of it.

Why: dropping a saved value for an activation budget makes the backward recompute the value's
closure, and a closure that reads an FSDP-gathered weight re-runs that weight's
``MUST_RECOMPUTE`` gather chain (cast, ``all_gather_into_tensor``, ``wait_tensor``, views): a
copy of a forward chain in the backward. The backward already
gathers the same weight for its own gradient matmuls (the first compilation's re-gathers), and
extraction keeps both: on the model kit (2 layers, half the replay's saved bytes) the backward
gathered 9 of its 21 weights twice, 30 all-gathers where 21 do, each one a weight's unsharded
bytes on the wire and in memory.

Two chains that apply the same ops to the same shard over the same group compute the same
value, so one can serve the readers of both. Every rank runs the same graph through the same
merge, so a collective dropped here is dropped on every rank: the ranks' collective sequences
stay matched. What is merged, on the backward's final order:

* each recomputed gather with the *nearest* backward gather equal to it (same key: a graph
  input, then the ops of :func:`_chain_ops` -- casts, the gather, its wait, views -- with the
  same arguments). Of two equal nodes the earlier one stays and serves both, so the one buffer
  lives from the first use to the last; nearest keeps that stretch short;
* never two of the backward's own gathers: where the first compilation gathered one weight
  twice (a module called in several layers), it chose to free the weight in between.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
import torch.fx as fx

from ap_partitioner import _compat

__all__ = ["merge_recomputed_gathers"]

Key = tuple[Any, ...]


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
    gather = _compat.c10d_functional_op("all_gather_into_tensor")
    return frozenset(ops | set(_compat.wait_ops()) | ({gather} - {None}))


def _frozen(value: Any, keys: Mapping[fx.Node, Key]) -> Any:
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


def _key(node: fx.Node, keys: Mapping[fx.Node, Key]) -> Key | None:
    """What ``node`` computes, if its inputs are chain values: its op and its arguments."""
    args = _frozen(node.args, keys)
    kwargs = tuple((name, _frozen(v, keys)) for name, v in sorted(node.kwargs.items()))
    if args is None or any(k is None and node.kwargs[n] is not None for n, k in kwargs):
        return None
    return (node.target, args, kwargs)


def _chain_keys(graph: fx.Graph) -> dict[fx.Node, Key]:
    """The key of every chain value of ``graph``: its graph inputs, and the :func:`_chain_ops`
    nodes computed from chain values only."""
    chain_ops = _chain_ops()
    keys: dict[fx.Node, Key] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            keys[node] = ("input", node.name)
        elif node.op == "call_function" and node.target in chain_ops:
            key = _key(node, keys)
            if key is not None:
                keys[node] = key
    return keys


def _pairs(
    groups: list[list[fx.Node]], own: Collection[str], order: Mapping[fx.Node, int]
) -> dict[fx.Node, fx.Node]:
    """``{gather merged away: gather kept}`` over groups of equal gathers. Each recomputed
    gather (not in ``own``) picks the nearest backward gather of its group; a backward gather
    and the recomputed ones that picked it become one, the earliest of them kept. Two backward
    gathers never share one."""
    picked: dict[fx.Node, list[fx.Node]] = {}  # a backward gather: the recomputed ones it serves
    for members in groups:
        backward = [n for n in members if n.name in own]
        if not backward:  # only recomputed gathers of this value: none is the backward's own
            continue
        for node in (n for n in members if n.name not in own):
            partner = min(backward, key=lambda o: (abs(order[o] - order[node]), order[o]))
            picked.setdefault(partner, []).append(node)
    into: dict[fx.Node, fx.Node] = {}
    for partner, recomputed in picked.items():
        first, *rest = sorted([partner, *recomputed], key=order.__getitem__)
        into.update(dict.fromkeys(rest, first))
    return into


def _fold(
    kept: fx.Node, away: fx.Node, keys: dict[fx.Node, Key], order: Mapping[fx.Node, int]
) -> None:
    """Point ``away``'s readers at ``kept`` (an earlier gather of the same value), fold each
    reader equal to another into the earliest of them (the waits, then the views), and erase
    what is left unread: ``away`` and the cast only it read."""
    graph, chain_ops = kept.graph, _chain_ops()
    away.replace_all_uses_with(kept)
    frontier = [kept]
    while frontier:
        node = frontier.pop()
        survivors: dict[Key, fx.Node] = {}
        for user in sorted(node.users, key=order.__getitem__):
            if user.op != "call_function" or user.target not in chain_ops:
                continue
            key = _key(user, keys)
            if key is None:
                continue
            keys[user] = key
            if key in survivors:  # equal to an earlier reader: that one serves both
                user.replace_all_uses_with(survivors[key])
                graph.erase_node(user)
                keys.pop(user)
            else:
                survivors[key] = user
        frontier.extend(survivors.values())
    dead = [away]
    while dead:
        node = dead.pop()
        if node.users or node not in keys:  # read by a kept node, or erased already
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        keys.pop(node)
        dead += [i for i in inputs if i.op == "call_function" and i in keys and not i.users]


def merge_recomputed_gathers(
    graph: fx.Graph, own: Collection[str] | Callable[[], Collection[str]]
) -> list[str]:
    """Merge each recomputed all-gather chain of the backward graph ``graph`` with the nearest
    backward chain that gathers the same value (see the module docstring). ``own``: the names
    of the all-gathers the joint graph runs in its backward (the first compilation's
    re-gathers; extraction keeps node names), or a function giving them, called only when some
    value is gathered twice; every other all-gather of ``graph`` is a forward one the
    partition recomputed. Returns the names of the all-gathers removed, in graph order (empty:
    the graph is unchanged)."""
    gather = _compat.c10d_functional_op("all_gather_into_tensor")
    gathers = [] if gather is None else graph.find_nodes(op="call_function", target=gather)
    if len(gathers) < 2:
        return []
    keys = _chain_keys(graph)
    by_key: dict[Key, list[fx.Node]] = {}
    for node in gathers:
        if node in keys:
            by_key.setdefault(keys[node], []).append(node)
    groups = [members for members in by_key.values() if len(members) > 1]
    if not groups:  # every value gathered once: the joint's backward set is not needed
        return []
    order = {node: i for i, node in enumerate(graph.nodes)}
    into = _pairs(groups, own() if callable(own) else own, order)
    for away in sorted(into, key=order.__getitem__):
        _fold(into[away], away, keys, order)
    return [n.name for n in sorted(into, key=order.__getitem__)]
