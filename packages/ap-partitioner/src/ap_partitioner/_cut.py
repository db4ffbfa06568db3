"""Is a save plan a valid cut of the joint graph?

The replayed save set comes from a *different* graph (the first compilation's), so nothing
guarantees it cuts this one. Extraction would then either raise deep inside torch
("Node x was invalid, but is output") or, worse, silently recompute a value that must not be
recomputed (a random op draws new numbers). This module names the values at fault up front so
the partitioner can fall back, or refuse, with a message a user can act on.
"""

from __future__ import annotations

import torch.fx as fx

from ap_partitioner import _compat
from ap_partitioner._rules import SavePlan, is_must_recompute


def _backward_inputs(joint: fx.Graph, plan: SavePlan) -> set[fx.Node]:
    """What the backward graph receives: the saved values plus its own placeholders."""
    mod = _compat.partitioners()
    given = set(plan.all_nodes())
    for node in joint.find_nodes(op="placeholder"):
        if mod._is_tangent(node) or mod._is_bwd_seed_offset(node) or mod._is_backward_state(node):
            given.add(node)
    return given


def _unrecomputable(node: fx.Node) -> bool:
    """Forward values the backward may never recompute itself.

    ``must_be_in_forward`` nodes (mutations, forward-only effects) are invalid in the backward
    by torch's own extraction rule; a random op re-run there draws different numbers unless it
    is tagged for recomputation (then torch functionalizes its RNG); an effectful op cannot
    join the backward's token chain.
    """
    mod = _compat.partitioners()
    if node.op == "placeholder":
        return True
    if mod._must_be_in_forward(node) or _compat.is_with_effects(node):
        return True
    return _compat.is_random(node) and not mod.must_recompute(node)


def missing_values(joint_module: fx.GraphModule, plan: SavePlan, num_fwd_outputs: int) -> list[str]:
    """Names of forward values the backward needs that are neither saved nor recomputable.

    Empty means the plan is a valid cut. Walks the graph once in topological order deciding
    "available in the backward" (given, or recomputable from available inputs), then walks back
    from the gradients through unavailable values to the roots that make them unavailable.
    """
    mod = _compat.partitioners()
    graph = joint_module.graph
    given = _backward_inputs(graph, plan)
    bw_roots = given - set(plan.all_nodes())
    backward_side: set[fx.Node] = set()
    available: dict[fx.Node, bool] = {}
    for node in graph.nodes:
        if node in bw_roots or any(i in backward_side for i in node.all_input_nodes):
            backward_side.add(node)
        if node in given:
            available[node] = True
        elif node.op == "output":
            continue
        elif node not in backward_side and _unrecomputable(node):
            available[node] = False
        else:
            available[node] = all(available.get(i, False) for i in node.all_input_nodes)

    _, bwd_outputs, _, _ = mod._extract_fwd_bwd_outputs(
        joint_module, num_fwd_outputs=num_fwd_outputs
    )
    roots: dict[str, None] = {}
    seen: set[fx.Node] = set()
    stack = [o for o in bwd_outputs if isinstance(o, fx.Node) and not available.get(o, False)]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        blocked = [i for i in node.all_input_nodes if not available.get(i, False)]
        if (node not in backward_side and _unrecomputable(node)) or (
            not blocked and not available.get(node, False)
        ):
            roots[node.name] = None
        stack.extend(blocked)
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    return sorted(roots, key=lambda name: order.get(name, -1))


def blocked_by_recompute_tag(joint_module: fx.GraphModule, names: list[str]) -> list[str]:
    """The subset of ``names`` whose save was refused by a MUST_RECOMPUTE tag (for messages)."""
    by_name = {n.name: n for n in joint_module.graph.nodes}
    return [name for name in names if name in by_name and is_must_recompute(by_name[name])]
