"""``max_gathered_bytes``: how many all-gathered bytes a graph holds at once, in its order.

Bucketing trades collectives for memory: a bucket's gathered weights are all alive from its
all-gather (its pack allocates the whole gathered buffer) until the last of them is read. This
measures that on the graph as ordered, with no device: every storage an all-gather fills (its
output, or the buffer its ``out=`` names: the ``"custom_ops"`` pack's) and every storage filled
in place from one (the unpack's ``out=`` member buffers), each alive from the node that
allocates it to the last node that reads it through any view. The peak of their sum over the
graph's positions is what a runtime executing the graph in this order holds (graph_trainer runs
its joint graph that way; Inductor may reorder further). Two graphs of one model compare
directly: ap-bucketing's block-wide buckets against torchtitan's own
``get_transformer_block_buckets``.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ._checks import require_graph
from ._hazards import _accesses, storage_roots, written_inputs
from ._sizes import hint_int

_ALL_GATHERS = (
    "all_gather_into_tensor",
    "all_gather_into_tensor_out",
    "all_gather_into_tensor_coalesced",
)


def _is_all_gather(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    name = getattr(node.target, "__name__", "").split(".")[0]
    return name in _ALL_GATHERS


def _bytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else (val,)
    total = 0
    for v in vals:
        if isinstance(v, torch.Tensor):
            total += (hint_int(v.untyped_storage().nbytes()) or 0) if _has_storage(v) else 0
    return total


def _has_storage(value: torch.Tensor) -> bool:
    try:
        value.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return False
    return True


def gathered_storages(graph: fx.Graph) -> set[fx.Node]:
    """The storage roots holding all-gathered data: all-gather outputs (or ``out=`` buffers)
    and buffers filled in place from one."""
    roots = storage_roots(graph)
    gathered: set[fx.Node] = set()
    for node in graph.nodes:
        if _is_all_gather(node):
            written = written_inputs(node)
            if written:  # into an out= buffer
                targets = written
            elif isinstance(node.meta.get("val"), (list, tuple)):  # coalesced: its getitems
                targets = list(node.users)
            else:
                targets = [node]
            gathered |= {roots.get(t, t) for t in targets}
            continue
        written = written_inputs(node)
        if written and any(
            roots.get(i, i) in gathered for i in node.all_input_nodes if i not in written
        ):
            gathered |= {roots.get(t, t) for t in written}
    return gathered


def max_gathered_bytes(graph: fx.Graph | fx.GraphModule) -> int:
    """Peak, over ``graph``'s order, of the bytes of all-gathered storages alive at once (see
    the module docstring). Needs ``meta['val']`` on the storages' nodes (a node without one
    counts 0 bytes)."""
    g = require_graph(graph, where="max_gathered_bytes")
    gathered = gathered_storages(g)
    if not gathered:
        return 0
    roots = storage_roots(g)
    order = list(g.nodes)
    pos = {n: i for i, n in enumerate(order)}
    last: dict[fx.Node, int] = {}
    for node in order:
        for storage, _ in _accesses(node, roots):
            if storage in gathered:
                last[storage] = pos[node]
    delta = [0] * (len(order) + 1)
    for storage in gathered:
        size = _bytes(storage)
        start = pos[storage]
        end = max(last.get(storage, start), start)
        delta[start] += size
        delta[end + 1] -= size
    peak = alive = 0
    for change in delta:
        alive += change
        peak = max(peak, alive)
    return peak
