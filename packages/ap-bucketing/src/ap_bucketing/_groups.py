"""Which process group is "the" FSDP group of a graph.

Torch's ``identify_fsdp_groups`` returns every group that carries an FSDP-shaped all-gather and
takes ``group_size`` from whichever such all-gather comes first. On graphs with several meshes
(dp, tp, a flattened dp x tp group for norm weights...) that makes minority groups "FSDP" too and
can size the bucket cap from the wrong group. Here the primary group is the one with the most
FSDP collectives, ties going to the group seen first, and ``group_size`` comes from that group.

FSDP collectives are all-gathers of one parameter **and reduce-scatters of a gradient that
leaves the graph unchanged**. Torch finds groups from all-gathers only, so a backward that only
reduce-scatters -- the ordinary one, where the forward saved the gathered weights -- has "no
FSDP group" and keeps one reduce-scatter per parameter, exactly where bucketing matters most.
Counting the reduce-scatters too makes torch's pre-bucketing reach that backward (its
reduce-scatter and all-reduce bucketing then run on the group found here). DDP's gradient
all-reduces, which leave the graph the same way, count likewise.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import torch.fx as fx

from . import _compat
from ._checks import require_graph_module

if TYPE_CHECKING:
    from ._compat import OrderedSet

log = logging.getLogger(__name__)


def _all_gathers(graph: fx.Graph) -> list[fx.Node]:
    found: list[fx.Node] = []
    for target in _compat.fsdp_all_gather_ops():
        found.extend(graph.find_nodes(op="call_function", target=target))
    return found


def _fsdp_all_gathers(gm: fx.GraphModule) -> list[fx.Node]:
    """All-gathers of exactly one placeholder (a parameter, optionally cast or padded): torch's
    own ``fsdp.is_fsdp_all_gather`` predicate, so both agree on what "FSDP" means. It walks
    backwards only until a second placeholder shows up, so FSDP chains cost O(chain)."""
    is_fsdp_all_gather = _compat.fsdp_all_gather_helpers()[0]
    return [n for n in _all_gathers(gm.graph) if is_fsdp_all_gather(n)]


def _gradient_collectives(gm: fx.GraphModule) -> list[fx.Node]:
    """Reduce-scatters, then all-reduces, whose wait flows to the graph's outputs through
    single-input ops: a gradient leaving the graph unchanged (FSDP's reduce-scatter, DDP's
    all-reduce). The predicate is torch's ``is_fsdp_reduce_scatter_wait``, which its FSDP
    reduce-scatter bucketing filters on, so a group is found exactly where torch will then
    bucket."""
    is_gradient_wait = _compat.fsdp_reduce_scatter_wait_predicate()
    wait = _compat.wait_tensor_op()
    found: list[fx.Node] = []
    for op in _compat.c10d_ops("reduce_scatter_tensor", "all_reduce"):
        found.extend(
            coll
            for coll in gm.graph.find_nodes(op="call_function", target=op)
            if any(
                u.op == "call_function" and u.target is wait and is_gradient_wait(u)
                for u in coll.users
            )
        )
    return found


def fsdp_group_counts(gm: fx.GraphModule) -> dict[Hashable, tuple[int, int | None]]:
    """``{group_name: (FSDP collective count, group_size of its first one)}`` in first-seen
    order: FSDP all-gathers in torch's ``_find_all_gathers`` order (plain, then ``_out``), then
    gradient reduce-scatters and all-reduces in graph order (an all-reduce has no
    ``group_size`` argument: ``None`` until a sized collective of its group is seen)."""
    _, get_group_name, get_group_size = _compat.fsdp_all_gather_helpers()
    (all_reduce,) = _compat.c10d_ops("all_reduce")
    counts: dict[Hashable, tuple[int, int | None]] = {}
    for coll in [*_fsdp_all_gathers(gm), *_gradient_collectives(gm)]:
        name = get_group_name(coll)
        count, size = counts.get(name, (0, None))
        if size is None and coll.target is not all_reduce:
            size = get_group_size(coll)
        counts[name] = (count + 1, size)
    return counts


def primary_fsdp_groups(gm: fx.GraphModule) -> tuple[OrderedSet[Any], int | None]:
    """``(OrderedSet([primary group]), its group_size)``; ``(OrderedSet(), None)`` if none.

    Same contract as torch's ``identify_fsdp_groups``. The primary group has the most FSDP
    collectives (all-gathers, gradient reduce-scatters and all-reduces, see the module
    docstring); on a tie the group whose first one is found first wins, so the result is
    deterministic and always a single group. A graph that only reduce-scatters (or all-reduces)
    gradients has a group too.
    """
    require_graph_module(gm, where="primary_fsdp_groups")
    counts = fsdp_group_counts(gm)
    if not counts:
        return _compat.ordered_set(), None
    primary = max(counts, key=lambda name: counts[name][0])  # max keeps the first on ties
    log.debug(
        "primary_fsdp_groups: primary=%r, counts=%r",
        primary,
        {k: v[0] for k, v in counts.items()},
    )
    return _compat.ordered_set([primary]), counts[primary][1]


def all_fsdp_groups(gm: fx.GraphModule) -> tuple[OrderedSet[Any], int | None]:
    """Every FSDP group (torch's behaviour, reduce-scatter groups included), ``group_size``
    from the primary group."""
    counts = fsdp_group_counts(gm)
    if not counts:
        return _compat.ordered_set(), None
    primary = max(counts, key=lambda name: counts[name][0])
    return _compat.ordered_set(counts), counts[primary][1]
