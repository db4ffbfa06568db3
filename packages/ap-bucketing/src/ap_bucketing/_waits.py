"""``merge_duplicate_waits``: one ``wait_tensor`` per collective before torch's bucketing runs.

torch's bucketers (``torch._inductor.fx_passes.bucketing``) assert that a collective has exactly
one user, its ``wait_tensor``. A graph can legitimately hold two waits of one collective: CSE
merges two identical reduce-scatters (min-cut's partitioner runs ``fx_graph_cse``), and each
kept its own wait. Seen on a real model: with the first compilation traced through Inductor's
decompositions (an experiment, not the shipped default), the bias gradients of two BatchNorms
whose outputs a residual add sums were the same ``sum`` of one tensor, so their FSDP
reduce-scatters became one node with two waits (timm's ResNet-10t: "Expected single user for
reduce_scatter_tensor_2, got {wait_tensor_78, wait_tensor_81}").

Waiting twice on one collective yields the same tensor twice, so the later waits are replaced
by the first: the values, and so the numerics, are unchanged.
"""

from __future__ import annotations

import logging

import torch.fx as fx

from . import _compat

log = logging.getLogger(__name__)


def merge_duplicate_waits(graph: fx.Graph) -> list[str]:
    """Replace every collective's second and later ``wait_tensor`` by its first (in graph
    order); return the names of the waits removed."""
    wait = _compat.wait_tensor_op()
    removed: list[str] = []
    for node in list(graph.nodes):
        waits = [u for u in node.users if u.op == "call_function" and u.target is wait]
        if len(waits) < 2:
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        first, *rest = sorted(waits, key=order.__getitem__)
        for extra in rest:
            extra.replace_all_uses_with(first)
            graph.erase_node(extra)
            removed.append(extra.name)
    if removed:
        log.info("merge_duplicate_waits: %s", removed)
    return removed
