"""The working copy a partition runs on, so the caller's joint graph is never modified.

Nodes are copied one by one and each node's ``meta`` dict is shallow-copied, so a partitioner
that refuses its input (``strict=True``) leaves the caller's graph exactly as it was, and a
min-cut fallback gets the graph as given rather than one half-normalized by the replay's
prologue.
"""

from __future__ import annotations

import torch.fx as fx

from ap_partitioner import _compat


def working_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a node-by-node copy of ``gm.graph`` (same names; each node's
    ``meta`` dict shallow-copied, so top-level tag writes never reach the caller's nodes).

    Its code is generated lazily: the working copy is only read as a graph, and an eager
    recompile here (and after each graph replacement in the prologue) cost more than the copy.
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    _compat.copy_codegen(gm.graph, graph)
    return _compat.deferred_codegen_module(gm, graph, gm.__class__.__name__)
