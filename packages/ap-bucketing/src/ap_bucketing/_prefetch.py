"""Prefetch of at most ``prefetch_depth`` collectives: the issue window FSDP2 keeps.

Torch's overlap scheduler launches a collective up to ``max_compute_pre_fetch`` compute nodes
ahead of its first consumer, bounded by bytes in flight. With block-wide buckets that can still
be several blocks on a small model, each holding its gathered weights from the launch on. FSDP2
issues the next ``fully_shard`` group's all-gather when the current group's is waited (a
prefetch of one) and keeps one reduce-scatter in flight; torchtitan's graph_trainer prefetches
one block. Here: the FSDP collectives of one kind and group form a chain in wait order (the
merged buckets and the FSDP-shaped collectives left unbucketed), and each member may be
*issued* -- its pack, which allocates the bucket, and the collective -- only after the wait of
the member ``prefetch_depth`` places before it. The pairs are handed to the same restore as the
write-order pairs (``_hazards.restore_order``): where the schedule keeps the window nothing
moves, and a launch hoisted further moves down just far enough.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch.fx as fx

from . import _compat

_KINDS = {
    "all_gather": (
        "all_gather_into_tensor",
        "all_gather_into_tensor_out",
        "all_gather_into_tensor_coalesced",
    ),
    "reduce_scatter": ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"),
}


def _kind(node: fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    name = getattr(node.target, "__name__", "").split(".")[0]
    for kind, names in _KINDS.items():
        if name in names:
            return kind
    return None


def _waits(coll: fx.Node) -> list[fx.Node]:
    """The collective's waits (a coalesced one's: the waits of its getitems)."""
    wait = _compat.wait_tensor_op()
    direct = [u for u in coll.users if u.target is wait]
    if direct:
        return direct
    return [w for g in coll.users for w in g.users if w.target is wait]


def _group(coll: fx.Node) -> Hashable:
    _, group_name, _ = _compat.fsdp_all_gather_helpers()
    try:
        name: Hashable = group_name(coll)
    except Exception:  # a collective whose arguments torch's helper cannot read
        return None
    return name


def fsdp_candidates(graph: fx.Graph, groups: set[Hashable]) -> set[fx.Node]:
    """The FSDP-shaped all-gathers and reduce-scatters of ``groups`` in ``graph`` as it is
    (before bucketing): the collectives whose issue the window bounds."""
    is_fsdp_all_gather, _, _ = _compat.fsdp_all_gather_helpers()
    is_fsdp_rs_wait = _compat.fsdp_reduce_scatter_wait_predicate()
    found: set[fx.Node] = set()
    for node in graph.nodes:
        kind = _kind(node)
        if kind is None or _group(node) not in groups:
            continue
        waits = _waits(node)
        if not waits:
            continue
        if kind == "all_gather" and is_fsdp_all_gather(node):
            found.add(node)
        elif kind == "reduce_scatter" and all(is_fsdp_rs_wait(w) for w in waits):
            found.add(node)
    return found


def chains(
    graph: fx.Graph, original: set[fx.Node], candidates: set[fx.Node], groups: set[Hashable]
) -> list[tuple[str, list[fx.Node]]]:
    """The window's chains in ``graph`` after bucketing: per (kind, group), the candidates
    still in the graph and the collectives the merge created, in the order of their waits."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    by_key: dict[tuple[str, Hashable], list[tuple[int, fx.Node]]] = {}
    for node in graph.nodes:
        kind = _kind(node)
        if kind is None:
            continue
        if node in original and node not in candidates:
            continue
        group = _group(node)
        if group not in groups:
            continue
        waits = _waits(node)
        if not waits:
            continue
        by_key.setdefault((kind, group), []).append((min(pos[w] for w in waits), node))
    return [
        (kind, [n for _, n in sorted(members, key=lambda e: e[0])])
        for (kind, _), members in by_key.items()
    ]


def _issue_nodes(coll: fx.Node, original: set[fx.Node]) -> list[fx.Node]:
    """The collective and what the merge built to feed it (its pack): the nodes that allocate
    and fill the bucket, found up the inputs through nodes not in ``original``."""
    found = [coll]
    stack = [n for n in coll.all_input_nodes if n not in original]
    seen = set(stack)
    while stack:
        node = stack.pop()
        found.append(node)
        for inp in node.all_input_nodes:
            if inp not in original and inp not in seen and inp.op != "placeholder":
                seen.add(inp)
                stack.append(inp)
    return found


def pull_up_reduce_scatter_waits(
    graph: fx.Graph, chain_list: list[tuple[str, list[fx.Node]]], original: set[fx.Node], depth: int
) -> int:
    """Move each reduce-scatter's wait up to just before the issue of the member ``depth``
    places after it, where the scheduler left it later (at the graph's end, its output's
    place): the window then holds one reduction in flight instead of pushing every later
    reduction (and the unsharded gradients it packs) down to the end. An all-gather's wait is
    left where it is (its consumer needs it there); its successor's issue moves down instead.
    Returns how many waits moved."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    moved = 0
    for kind, chain in chain_list:
        if kind != "reduce_scatter":
            continue
        for earlier, later in zip(chain, chain[depth:], strict=False):
            issue = min(_issue_nodes(later, original), key=pos.__getitem__)
            for wait in _waits(earlier):
                if pos[wait] > pos[issue] and pos[earlier] < pos[issue]:
                    issue.prepend(wait)
                    moved += 1
        pos = {n: i for i, n in enumerate(graph.nodes)}
    return moved


def hoist_issues(
    graph: fx.Graph, chain_list: list[tuple[str, list[fx.Node]]], original: set[fx.Node], depth: int
) -> int:
    """ap's own prefetch (``OverlapBucketingPass(reorder="prefetch")``): issue each
    all-gather of a chain -- its pack and the collective -- right after the wait of the one
    ``depth`` places before it, where it sits later; FSDP2's and graph_trainer's schedule,
    with no cost model and nothing else moved. Returns how many nodes moved. An issue whose
    inputs are not all above that wait stays."""
    moved = 0
    for kind, chain in chain_list:
        if kind != "all_gather":
            continue
        for earlier, later in zip(chain, chain[depth:], strict=False):
            pos = {n: i for i, n in enumerate(graph.nodes)}
            waits = _waits(earlier)
            if not waits:
                continue
            anchor = max(waits, key=pos.__getitem__)
            group = sorted(_issue_nodes(later, original), key=pos.__getitem__)
            if pos[group[0]] <= pos[anchor]:
                continue
            members = set(group)
            inputs = {i for n in group for i in n.all_input_nodes if i not in members}
            if any(pos[i] > pos[anchor] for i in inputs):
                continue
            target = anchor
            for node in group:
                target.append(node)
                target = node
                moved += 1
    return moved


def window_edges(
    chain_list: list[tuple[str, list[fx.Node]]], original: set[fx.Node], depth: int
) -> list[tuple[fx.Node, fx.Node]]:
    """``(wait of member i, issue node of member i + depth)`` for every chain."""
    edges: list[tuple[fx.Node, fx.Node]] = []
    for _, chain in chain_list:
        for earlier, later in zip(chain, chain[depth:], strict=False):
            waits = _waits(earlier)
            for issue in _issue_nodes(later, original):
                edges.extend((w, issue) for w in waits)
    return edges
