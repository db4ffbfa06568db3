"""Undo torch's bucketing of a graph when it fails half-way.

Torch merges a bucket in place (insert the merged collective, erase the members) and only then
reorders the region around it; when that reorder fails (``AssertionError: stable topological
sort of region failed``, torchtitan#4047) the graph is already rewritten, possibly cyclic, and
earlier buckets are merged too. ``checkpoint`` copies the graph before the passes start;
``restore`` empties the graph in place and copies the checkpoint back (names, meta, order), so
the caller's ``graph`` object -- the one Inductor goes on compiling -- is left unbucketed.
"""

from __future__ import annotations

import copy

import torch.fx as fx

from . import _compat


def checkpoint(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` to restore from (``Graph.__deepcopy__``: nodes copied in order with
    their names, each meta dict shallow-copied, values shared)."""
    return copy.deepcopy(graph)


def restore(graph: fx.Graph, saved: fx.Graph) -> None:
    """Make ``graph`` (in place) what it was when ``saved`` was taken."""
    nodes = list(graph.nodes)
    for node in nodes:  # drop every edge first: the failed graph may hold a cycle
        node.args, node.kwargs = (), {}
    for node in reversed(nodes):
        graph.erase_node(node)
    _compat.reset_graph_namespace(graph)
    copied = graph.graph_copy(saved, {}, return_output_node=True)
    if not isinstance(copied, tuple):  # the saved graph had no output node
        return
    value, saved_output = copied
    output = graph.output(value, type_expr=getattr(saved_output, "type", None))
    output.meta = copy.copy(saved_output.meta)


def unsortable_nodes(graph: fx.Graph) -> list[fx.Node]:
    """Nodes of ``graph`` no topological order can place (on or behind a cycle), in graph
    order: what a failed merge left behind, for the message. Kahn's algorithm, O(nodes)."""
    pending = {node: len(node.all_input_nodes) for node in graph.nodes}
    ready = [node for node, count in pending.items() if count == 0]
    placed: set[fx.Node] = set()
    while ready:
        node = ready.pop()
        placed.add(node)
        for user in node.users:
            pending[user] -= 1
            if pending[user] == 0:
                ready.append(user)
    return [node for node in graph.nodes if node not in placed]
