"""Where lifting torch's ban on recomputing what the backward materializes would change numerics.

``"min_cut_fusible"`` (the default first partitioner) runs torch's min-cut without
``ban_recompute_materialized_backward``: a pointwise value a backward matmul reads is recomputed
in a backward kernel instead of saved. That is exact when the recomputation computes the same
bits as the forward did. One pattern breaks it: a chain that rounds to a narrower float and
widens again (``F.silu(x.to(torch.bfloat16)).float()``, a decomposition's upcast after a
user's downcast). Inductor elides such downcast-upcast pairs inside a fused kernel unless
``emulate_precision_casts`` is set, and whether the pair is inside one kernel depends on how
the forward and the backward each fuse -- so the backward's copy of the value can differ from
the forward's by a rounding (measured: a bf16 ``silu`` MLP's weight gradient 2.4e-5 off stock
``torch.compile``'s, on a gradient of 1.3e-2; the kit's bf16 mixed precision, whose chains
round only at their ends, is bit-identical to it).

So such a value keeps torch's ban: :func:`keep_ban_on_rounded_values` tags it ``MUST_SAVE``
for the first partition's min-cut (which then bans its recomputation exactly as with the ban
on) and :func:`clear_kept_bans` removes the tags from the joint and the partitioned graphs
afterwards, so nothing downstream (the replay, the retrace's meta) sees them.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
import torch.fx
from ap_tags.graph import backward_nodes
from torch.utils.checkpoint import CheckpointPolicy

from ap_backend import _compat

__all__ = [
    "clear_kept_bans",
    "keep_ban_on_rounded_values",
    "materialized_in_backward",
    "rounding_values",
    "rounds_through_low_precision",
]

#: A node tagged by :func:`keep_ban_on_rounded_values` (the tag is ours to remove).
KEPT_BAN = "ap_kept_materialized_ban"

_CASTS = (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)


def _dtype(value: object) -> torch.dtype | None:
    return value.dtype if isinstance(value, torch.Tensor) else None


def _cast_bits(node: torch.fx.Node) -> tuple[int, int] | None:
    """``(bits in, bits out)`` of a float-to-float cast node, else None."""
    if node.op != "call_function" or node.target not in _CASTS or not node.args:
        return None
    src = node.args[0]
    if not isinstance(src, torch.fx.Node):
        return None
    before, after = _dtype(src.meta.get("val")), _dtype(node.meta.get("val"))
    if before is None or after is None or before == after:
        return None
    if not (before.is_floating_point and after.is_floating_point):
        return None
    return torch.finfo(before).bits, torch.finfo(after).bits


def _is_narrowing(node: torch.fx.Node) -> bool:
    """A cast that loses precision: fewer bits, or bf16 <-> fp16 (each drops what the other
    keeps)."""
    bits = _cast_bits(node)
    return bits is not None and bits[1] <= bits[0]


def _is_widening(node: torch.fx.Node) -> bool:
    bits = _cast_bits(node)
    return bits is not None and bits[1] > bits[0]


def rounding_values(
    nodes: Iterable[torch.fx.Node], fusible: Iterable[torch.fx.Node]
) -> set[torch.fx.Node]:
    """The nodes of ``fusible`` (``nodes`` in graph order) whose fusible region -- the node and
    the ancestors it reaches through fusible ops, what a backward recomputation of it could run
    in one kernel -- rounds to a narrower float and widens again: the downcast-upcast pair
    Inductor may elide in one kernel and keep in another.

    Why only a pair: a chain that narrows at its end (a bf16 op's result, a norm's
    ``.to(bf16)``) stores the rounded value in whichever kernel computes it, forward or
    backward; only a widening after a narrowing can see the unrounded value in one of them.
    One pass in graph order (a node's region holds its fusible arguments' regions)."""
    allowed = set(fusible)
    narrowed: set[torch.fx.Node] = set()  # a narrowing cast is in the region, strictly before
    rounds: set[torch.fx.Node] = set()
    for node in nodes:
        if node not in allowed:
            continue
        args = [a for a in node.all_input_nodes if a in allowed]
        if any(a in narrowed or _is_narrowing(a) for a in args):
            narrowed.add(node)
        if any(a in rounds for a in args) or (node in narrowed and _is_widening(node)):
            rounds.add(node)
    return rounds


def rounds_through_low_precision(node: torch.fx.Node, fusible: Iterable[torch.fx.Node]) -> bool:
    """Whether ``node`` is one of :func:`rounding_values` of its graph."""
    return node in rounding_values(node.graph.nodes, fusible)


def materialized_in_backward(
    node: torch.fx.Node, backward: set[torch.fx.Node], op_types: object
) -> bool:
    """torch's ``is_materialized_backwards``: a backward user (through views) that cannot fuse
    with ``node`` -- recomputing ``node`` there must write it out. ``op_types`` is torch's
    partitioner op list (``is_fusible`` / ``is_view``)."""
    is_fusible = op_types.is_fusible  # type: ignore[attr-defined]
    is_view = op_types.is_view  # type: ignore[attr-defined]
    if is_view(node):
        return False
    pending = [node]
    seen = {node}
    while pending:
        cur = pending.pop()
        for user in cur.users:
            if user in backward and not (
                user.target is torch.ops.aten.cat.default or (is_fusible(cur) and is_fusible(user))
            ):
                return True
            if is_view(user) and user not in seen:
                seen.add(user)
                pending.append(user)
    return False


def keep_ban_on_rounded_values(joint: torch.fx.GraphModule) -> list[str]:
    """Tag ``MUST_SAVE`` (for the first partition's min-cut only) on each untagged forward
    value that is materialized in the backward and rounds through low precision: torch's ban
    on recomputing it stays on there. Returns the tagged nodes' names."""
    graph = joint.graph
    op_types = _compat.partitioner_op_types()
    backward = backward_nodes(graph)
    forward = [n for n in graph.nodes if n not in backward and n.op == "call_function"]
    fusible = [n for n in forward if n.target is not operator.getitem and op_types.is_fusible(n)]
    rounding = rounding_values(graph.nodes, fusible)
    kept = []
    for node in fusible:
        if node not in rounding or "recompute" in node.meta:
            continue  # a tag (FSDP chain, AC, the user's SAC) already decides
        if not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        if materialized_in_backward(node, backward, op_types):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            node.meta[KEPT_BAN] = True
            kept.append(node.name)
    return kept


def clear_kept_bans(*graphs: torch.fx.GraphModule) -> None:
    """Remove :func:`keep_ban_on_rounded_values`' tags (and only them) from ``graphs`` -- the
    joint and what the partitioner copied them into."""
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.meta.pop(KEPT_BAN, False):
                node.meta.pop("recompute", None)
