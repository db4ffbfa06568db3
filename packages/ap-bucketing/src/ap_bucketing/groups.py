"""Which process group is "the" FSDP group of a graph.

Torch's ``identify_fsdp_groups`` returns every group that carries an FSDP-shaped all-gather and
takes ``group_size`` from whichever such all-gather comes first. On graphs with several meshes
(dp, tp, a flattened dp x tp group for norm weights...) that makes minority groups "FSDP" too and
can size the bucket cap from the wrong group. Here the primary group is the one with the most
FSDP all-gathers, ties going to the group seen first, and ``group_size`` comes from that group.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable
from typing import Any

import torch
import torch.fx as fx
from torch.utils._ordered_set import OrderedSet

from . import _compat

log = logging.getLogger(__name__)


def _all_gathers(graph: fx.Graph) -> list[fx.Node]:
    ops = torch.ops._c10d_functional
    targets = [ops.all_gather_into_tensor.default, ops.all_gather_into_tensor_out.default]
    found: list[fx.Node] = []
    for target in targets:
        found.extend(graph.find_nodes(op="call_function", target=target))
    return found


def _single_placeholder_ancestor(graph: fx.Graph, wanted: Iterable[fx.Node]) -> set[fx.Node]:
    """The subset of ``wanted`` whose ancestry holds exactly one placeholder.

    Same predicate as torch's ``fsdp.is_fsdp_all_gather`` (a parameter, optionally cast or
    padded, then gathered), computed in one topological sweep that keeps at most two
    placeholder ancestors per node, instead of one backward BFS per all-gather.
    """
    wanted_set = set(wanted)
    remaining = len(wanted_set)
    ancestors: dict[fx.Node, tuple[fx.Node, ...]] = {}
    result: set[fx.Node] = set()
    for node in graph.nodes:
        if remaining == 0:
            break
        if node.op == "placeholder":
            ancestors[node] = (node,)
        else:
            seen: list[fx.Node] = []
            for inp in node.all_input_nodes:
                for ph in ancestors.get(inp, ()):
                    if ph not in seen:
                        seen.append(ph)
                if len(seen) > 1:
                    break
            ancestors[node] = tuple(seen[:2])
        if node in wanted_set:
            remaining -= 1
            if len(ancestors[node]) == 1:
                result.add(node)
    return result


def _fsdp_all_gathers(gm: fx.GraphModule) -> list[fx.Node]:
    ags = _all_gathers(gm.graph)
    fsdp_like = _single_placeholder_ancestor(gm.graph, ags)
    return [n for n in ags if n in fsdp_like]


def fsdp_group_counts(gm: fx.GraphModule) -> dict[Hashable, tuple[int, int | None]]:
    """``{group_name: (FSDP all-gather count, group_size of its first one)}`` in first-seen
    order (torch's ``_find_all_gathers`` order: plain all-gathers, then ``_out`` variants)."""
    get_group_name = _compat.attr(_compat.FSDP_MODULE, "_get_group_name")
    get_group_size = _compat.attr(_compat.FSDP_MODULE, "_get_group_size_from_node")
    counts: dict[Hashable, tuple[int, int | None]] = {}
    for ag in _fsdp_all_gathers(gm):
        name = get_group_name(ag)
        if name in counts:
            count, size = counts[name]
            counts[name] = (count + 1, size)
        else:
            counts[name] = (1, get_group_size(ag))
    return counts


def primary_fsdp_groups(gm: fx.GraphModule) -> tuple[OrderedSet[Any], int | None]:
    """``(OrderedSet([primary group]), its group_size)``; ``(OrderedSet(), None)`` if none.

    Same contract as torch's ``identify_fsdp_groups``. The primary group has the most FSDP
    all-gathers; on a tie the group whose first FSDP all-gather is found first wins, so the
    result is deterministic and always a single group.
    """
    counts = fsdp_group_counts(gm)
    if not counts:
        return OrderedSet(), None
    primary = max(counts, key=lambda name: counts[name][0])  # max keeps the first on ties
    log.debug(
        "primary_fsdp_groups: primary=%r, counts=%r",
        primary,
        {k: v[0] for k, v in counts.items()},
    )
    return OrderedSet([primary]), counts[primary][1]


def all_fsdp_groups(gm: fx.GraphModule) -> tuple[OrderedSet[Any], int | None]:
    """Every FSDP group (torch's behaviour), but ``group_size`` from the primary group."""
    counts = fsdp_group_counts(gm)
    if not counts:
        return OrderedSet(), None
    primary = max(counts, key=lambda name: counts[name][0])
    return OrderedSet(counts), counts[primary][1]
