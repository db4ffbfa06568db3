"""``max_consec_compute_between_rs``: how much compute piles up between reduce-scatters.

A backward graph whose reduce-scatters got bucketed across many layers (or reordered behind
them) runs long stretches of matmuls with every gradient still alive: the "MM x N" peak-memory
pattern the span cap exists to prevent. The longest run of compute nodes with no reduce-scatter
in between is a cheap proxy for it, computed before and after scheduling.
"""

from __future__ import annotations

import torch.fx as fx

from . import _compat
from ._checks import require_graph


def is_reduce_scatter(node: fx.Node) -> bool:
    """A reduce-scatter, by a substring match on the op name: covers the plain and coalesced
    functional collectives and torch's pre-bucketing custom op; waits are excluded. (The
    workspace's ``ap_tags.graph.is_reduce_scatter`` means the same on functional collectives;
    a cross-package test holds the two together.)"""
    name = str(node.target)
    return "reduce_scatter" in name and "wait" not in name


def max_consec_compute_between_rs(graph: fx.Graph | fx.GraphModule) -> int:
    """Longest run of compute nodes (torch's ``is_compute_node``: ops with a flop formula)
    not separated by a reduce-scatter, counting the leading and trailing runs. A graph with no
    reduce-scatter returns its total compute count."""
    g = require_graph(graph, where="max_consec_compute_between_rs")
    is_compute_node = _compat.is_compute_node_predicate()
    longest = current = 0
    for node in g.nodes:
        if node.op != "call_function":
            continue
        if is_compute_node(node):
            current += 1
            longest = max(longest, current)
        elif is_reduce_scatter(node):
            current = 0
    return longest
