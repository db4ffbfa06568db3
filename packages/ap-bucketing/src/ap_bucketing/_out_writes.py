"""Reads of a buffer stay after the ``out=`` op that fills it, through overlap scheduling.

torch's ``"custom_ops"`` bucket form unpacks a gathered bucket with
``split_with_sizes_copy.out(flat, sizes, 1, out=[alias(empty_0), ...])`` and hands each member
to its consumers as ``view(empty_i, shape)``: the consumers read ``empty_i`` with no data edge
to the copy that fills it; only the graph's order says "after". torch's overlap scheduler
orders nodes by data edges alone, so it may schedule a consumer (the embedding lookup of a
gathered weight) before the copy, and the compiled graph reads uninitialised memory (NaN
losses in a 2-rank gloo run of the backend with ``bucket_mode="custom_ops"``).

:func:`out_write_edges` records those write-before-read pairs on the graph before scheduling;
:func:`restore_out_write_order` re-sorts the scheduled graph so every pair holds again, keeping
the scheduler's order wherever it already does.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

import torch
import torch.fx as fx

from ap_bucketing import _compat

aten = torch.ops.aten


def is_view(node: fx.Node) -> bool:
    """``node``'s output shares its first argument's storage, so reading it reads the base: an
    op whose schema says it is a view (``view``, ``reshape``, ``slice``, ``t``, ``expand``,
    ``alias``, ...) or ``_unsafe_view`` (a view autograd does not track as one). Decided by
    the schema rather than a list, so a view op missing from a list can never let a read of
    an ``out=`` buffer slip above its write (ap-tags' ``aliases_input`` is the same rule;
    ``tests/test_vocabulary_agreement.py`` holds them together)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, _compat.op_overload_type()):
        return False
    return bool(getattr(target, "is_view", False)) or target is aten._unsafe_view.default


def _view_chain(node: fx.Node) -> list[fx.Node]:
    """``node`` and the views it is taken through, down to the storage's base (last)."""
    chain = [node]
    while is_view(chain[-1]) and isinstance(chain[-1].args[0], fx.Node):
        chain.append(chain[-1].args[0])
    return chain


def _readers(base: fx.Node) -> set[fx.Node]:
    """Every node that reads ``base``'s storage: its views (transitively) and their users."""
    found: set[fx.Node] = set()
    stack = [base]
    while stack:
        for user in stack.pop().users:
            if user not in found:
                found.add(user)
                if is_view(user):
                    stack.append(user)
    return found


def _out_targets(node: fx.Node) -> list[fx.Node]:
    if node.op != "call_function":
        return []
    out = node.kwargs.get("out")
    outs = out if isinstance(out, (list, tuple)) else [out]
    return [o for o in outs if isinstance(o, fx.Node)]


def out_write_edges(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node]]:
    """``(writer, reader)`` pairs of ``graph`` as it is now: ``writer`` fills a buffer through
    its ``out=`` argument and ``reader`` reads that buffer later in the graph's order -- the
    order that gives the graph its meaning, and the only thing that says the read comes after.
    """
    pos = {n: i for i, n in enumerate(graph.nodes)}
    edges: list[tuple[fx.Node, fx.Node]] = []
    for writer in graph.nodes:
        for target in _out_targets(writer):
            chain = _view_chain(target)
            edges.extend(
                (writer, r)
                for r in _readers(chain[-1])
                if r is not writer and r not in chain and pos[r] > pos[writer]
            )
    return edges


def restore_out_write_order(graph: fx.Graph, edges: Iterable[tuple[fx.Node, fx.Node]]) -> int:
    """Re-sort ``graph`` so that every ``(writer, reader)`` edge (of nodes still in it) has the
    writer first; returns how many nodes now sit at another position.

    A stable topological sort over data edges plus these edges, ties broken by the current
    position: where the scheduler's order already satisfies every edge nothing moves, and a
    reader it hoisted above its writer moves down just far enough (with what depends on it).
    """
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    extra: dict[fx.Node, list[fx.Node]] = {}
    violated = False
    for writer, reader in edges:
        if writer in pos and reader in pos:
            extra.setdefault(writer, []).append(reader)
            violated = violated or pos[reader] < pos[writer]
    if not violated:
        return 0
    indegree = {n: len(n.all_input_nodes) for n in nodes}
    for readers in extra.values():
        for reader in readers:
            indegree[reader] += 1
    ready = [pos[n] for n in nodes if indegree[n] == 0]
    heapq.heapify(ready)
    order: list[fx.Node] = []
    while ready:
        node = nodes[heapq.heappop(ready)]
        order.append(node)
        for succ in (*node.users, *extra.get(node, ())):
            indegree[succ] -= 1
            if indegree[succ] == 0:
                heapq.heappush(ready, pos[succ])
    if len(order) != len(nodes):
        stuck = sorted((n for n in nodes if indegree[n] > 0), key=pos.__getitem__)
        raise RuntimeError(
            "restore_out_write_order: the out= write edges form a cycle with the data edges "
            f"at node {stuck[0].name!r}; the graph is left as the scheduler ordered it"
        )
    output = graph.output_node()
    for node in order:
        if node is not output:
            output.prepend(node)
    return sum(1 for i, n in enumerate(order) if pos[n] != i)


__all__ = ["is_view", "out_write_edges", "restore_out_write_order"]
