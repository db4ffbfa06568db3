"""The replay's epilogue: min-cut's, with its two graph-reordering steps done in place.

After extraction the backward must be ordered the way the autograd engine would run it (torch's
``reordering_to_mimic_autograd_engine``: from the first node that reads a tangent onwards, each
node is preceded only by the recomputed forward nodes it needs, so recomputations stay short-
lived) and every ``getitem`` must follow its multi-output parent (``raise_getitems``). torch does
the first by copying every backward node into a new graph and wrapping it in an eager
``GraphModule`` (Python code generated and ``exec``-ed on construction), and the second by a
``recompile``: two code generations and a full graph copy, about a third of a 32-layer replay.

Here both are node *moves* in the extracted graph itself, the same algorithm and the same
resulting node order (``tests/test_epilogue.py`` holds them to torch's on real partitions),
and the module keeps the lazy code generation the extraction gave it under ``torch.compile``:
its code is generated once, when Inductor (or anyone) first needs it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ap_partitioner import _compat
from ap_partitioner._prologue import Prologue


def autograd_order_in_place(gm: fx.GraphModule) -> fx.GraphModule:
    """Reorder ``gm``'s backward graph as torch's ``reordering_to_mimic_autograd_engine``
    does, by moving nodes: placeholders first; then, from the first node that reads a tangent
    (earlier ``aten.copy_`` nodes first: they may read no tangent), each node preceded by the
    not yet placed nodes it depends on, in original order. Nodes never placed (forward
    leftovers nothing placed reads) are erased, as torch's copy drops them. Returns ``gm``."""
    mod = _compat.partitioners()
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    first_bwd = min(
        (order[user] for node in nodes if mod._is_tangent(node) for user in node.users),
        default=None,
    )
    if first_bwd is None:
        return gm  # gradients do not read the tangents: torch leaves the graph as it is
    placed: set[fx.Node] = set()
    cursor: fx.Node | None = None  # the last placed node

    def place(node: fx.Node) -> None:
        nonlocal cursor
        if cursor is None:
            head = next(iter(graph.nodes))
            if head is not node:
                head.prepend(node)
        else:
            cursor.append(node)
        cursor = node
        placed.add(node)

    for node in graph.find_nodes(op="placeholder"):
        place(node)

    def place_with_inputs(root: fx.Node) -> None:
        if root in placed:
            return
        todo, found = [root], set()
        while todo:
            node = todo.pop()
            if node in found or node in placed:
                continue
            found.add(node)
            todo.extend(node.all_input_nodes)
        for node in sorted(found, key=order.__getitem__):
            place(node)

    for node in nodes[:first_bwd]:
        if node.op == "call_function" and node.target is torch.ops.aten.copy_.default:
            place_with_inputs(node)
    for node in nodes[first_bwd:]:
        place_with_inputs(node)
    for node in reversed(nodes):
        if node not in placed:
            graph.erase_node(node)
    gm.recompile()  # lazy under torch.compile: marks the code stale, generates nothing
    return gm


def raise_getitems_in_place(gm: fx.GraphModule) -> fx.GraphModule:
    """Move every ``getitem`` right after its parent, keeping the getitems' relative order
    (torch's ``raise_getitems``). Returns ``gm``."""
    for node in reversed(list(gm.graph.find_nodes(op="call_function", target=operator.getitem))):
        inputs = node.all_input_nodes
        if len(inputs) != 1:
            raise AssertionError(f"expected node {node.name} to have 1 input node, got {inputs}")
        inputs[0].append(node)
    gm.recompile()
    return gm


def run_epilogue(
    prologue: Prologue,
    fw_module: fx.GraphModule,
    bw_module: fx.GraphModule,
    num_saved_sym_nodes: int,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """min-cut's epilogue: RNG functionalization, autograd-order backward, raised getitems,
    graph-safe RNG threading through HOPs (the two reorderings in place, see the module doc)."""
    mod = _compat.partitioners()
    if prologue.has_recomputable_ops and prologue.has_recomputable_rng_ops:
        fw_module, bw_module = mod.functionalize_rng_ops(
            prologue.module, fw_module, bw_module, num_saved_sym_nodes
        )
    bw_module = autograd_order_in_place(bw_module)
    fw_module = raise_getitems_in_place(fw_module)
    bw_module = raise_getitems_in_place(bw_module)
    fw_module = mod.thread_graphsafe_rng_from_hops(fw_module, is_backward=False)
    bw_module = mod.thread_graphsafe_rng_from_hops(bw_module, is_backward=True)
    return fw_module, bw_module
