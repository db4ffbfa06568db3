"""FSDP collectives out of a chunked region's span, into the dense stretch around it.

Why: inside a chunked region's span the overlap schedule keeps token exchanges in flight under
the chunks' compute. An FSDP all-gather (a MoE layer's shared-expert or router weight
re-gathered for the backward) or a gradient reduce-scatter in that span is in flight at the
same time: it competes with the exchanges for the link and the communication threads, and the
list scheduler treats it as one more launch to wait on. Before the region, in the dense work
that precedes it, the same all-gather hides under compute that has nothing else in flight.

What moves, only along dependencies (a permutation of the graph's nodes, so every value is
bitwise the same), for each FSDP collective in flight inside the span (launched inside it, or
launched before it and waited inside or after it):

* an **all-gather** launched inside the span goes, with the nodes of the span it reads (its
  casts), to the start of the dense stretch before the span, and its wait to just before the
  span. It is left where it is when it reads a node of the region's body or a node that must
  keep its order (a mutation, a random op);
* a **reduce-scatter** launched inside the span goes, with the nodes of the span that read it,
  to just after the span, its wait to the end of the dense stretch after it. It is left where it
  is when the region's body reads its result;
* a collective launched before the span: its wait moves to just before the span (it completes
  before the exchanges start).

The *dense stretch* before (after) the span is the run of nodes next to it that are not a
collective or a wait, not part of another chunked region, of the region's direction, and keep
no order (mutations, random ops): other collectives keep their relative order, and nothing
crosses into another region or between forward and backward. The cost: a hoisted all-gather's
full weight lives through that stretch (as with FSDP's backward prefetch of the next layer).
On the EP zoo models the stretch before a MoE layer's backward span is the backward work
since the previous collective (the re-gathers of the attention or output layer after it).

What counts as FSDP (torch's own FSDP bucketing predicates, ``fx_passes/fsdp.py``, called): an
all-gather whose input derives from exactly one placeholder (a parameter shard, through casts),
or that ``ap_tags.mark_fsdp_all_gather_recomputation`` tagged (on torch 2.11, which has no
``is_fsdp_all_gather``: one it would tag, ``ap_tags.is_fsdp_chain_all_gather``); a
reduce-scatter whose wait flows to the graph's outputs through single-input ops only (a
gradient leaving the step).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch.fx
from ap_tags import CHUNK_REGION, FSDP_AC_GRAPH_ID, ac_graph_id
from ap_tags.graph import is_all_gather, is_backward_node, is_collective, is_reduce_scatter, is_wait

from . import _compat
from ._schedule_order import keeps_order, order_edges
from ._schedule_regions import ChunkedRegion, ancestors_within, descendants_within, first_wait

log = logging.getLogger(__name__)


@dataclass
class RegionPlacement:
    """What :func:`place_fsdp_collectives_of` did around one region: ``moved``, the FSDP
    collectives now outside its span; ``left``, ``"name: reason"`` of those it left inside."""

    moved: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)


def is_fsdp_collective(node: torch.fx.Node) -> bool:
    """An FSDP parameter all-gather or gradient reduce-scatter (module doc), by torch's own
    predicates (:func:`ap_epchunk._compat.fsdp_collective_predicates`) or ap-tags' FSDP tag."""
    if not is_collective(node):
        return False
    is_fsdp_all_gather, is_fsdp_reduce_scatter_wait = _compat.fsdp_collective_predicates()
    if is_all_gather(node):
        return ac_graph_id(node) == FSDP_AC_GRAPH_ID or bool(is_fsdp_all_gather(node))
    if is_reduce_scatter(node):
        wait = first_wait(node)
        return wait is not None and bool(is_fsdp_reduce_scatter_wait(wait))
    return False


def _other_region(node: torch.fx.Node, root: str) -> bool:
    """``node`` belongs to another chunked region than ``root`` (the region's own glue --
    the split of its inputs before its span -- is dense work like any other)."""
    custom = node.meta.get("custom")
    owner = custom.get(CHUNK_REGION) if isinstance(custom, dict) else None
    return owner is not None and owner != root


def _is_barrier(node: torch.fx.Node, region: ChunkedRegion) -> bool:
    """Where a dense stretch next to ``region``'s span ends (module doc)."""
    return (
        node.op != "call_function"
        or is_collective(node)
        or is_wait(node)
        or _other_region(node, region.root)
        or is_backward_node(node) != region.backward
        or keeps_order(node)
    )


def _stretch_start(first: torch.fx.Node, region: ChunkedRegion) -> torch.fx.Node:
    """The first node of the dense stretch that ends just before ``first`` (``first`` itself
    when there is none)."""
    node = first
    while node.prev.op != "root" and not _is_barrier(node.prev, region):
        node = node.prev
    return node


def _stretch_end(last: torch.fx.Node, region: ChunkedRegion) -> torch.fx.Node:
    """The node just after the dense stretch that starts just after ``last`` (its first
    barrier)."""
    node = last.next
    while node.op != "root" and not _is_barrier(node, region):
        node = node.next
    return node


def _pinned(
    moving: set[torch.fx.Node],
    edges: dict[torch.fx.Node, set[torch.fx.Node]],
    earlier: bool,
) -> str | None:
    """Why ``moving`` cannot move ``earlier`` (else later) past the nodes that stay: it holds a
    mutation or random op, or the move would break an order
    :func:`ap_epchunk._schedule_order.order_edges` keeps (a read of a value a mutation writes
    stays on its side of the mutation)."""
    for node in moving:
        if keeps_order(node):
            return f"it holds {node.name!r}, a mutation or random op that keeps its order"
    for node, behind in edges.items():
        # moving earlier breaks "node after x" for a moving node and an x that stays; moving
        # later breaks it for a node that stays and a moving x
        held = (behind - moving) if node in moving else set()
        if not earlier:
            held = (behind & moving) if node not in moving else set()
        if held:
            other = min(held, key=lambda n: n.name)
            return f"{node.name!r} must stay behind {other.name!r} (a mutation or what it writes)"
    return None


def _ordered(nodes: Iterable[torch.fx.Node], pos: dict[torch.fx.Node, int]) -> list[torch.fx.Node]:
    return sorted(nodes, key=pos.__getitem__)


def place_fsdp_collectives_of(graph: torch.fx.Graph, region: ChunkedRegion) -> RegionPlacement:
    """Move the FSDP collectives in flight inside ``region``'s span out of it (module doc),
    in place. A collective it cannot move is reported in ``left`` with the reason."""
    placement = RegionPlacement()
    body = set(region.body())
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    lo = min(pos[n] for n in body)
    hi = max(pos[n] for n in body)
    window = nodes[lo : hi + 1]
    inside = set(window)
    edges = order_edges(window)
    first, last = window[0], window[-1]
    # computed once, before anything moves: the moved launches are barriers themselves
    start = _stretch_start(first, region)
    end = _stretch_end(last, region)
    sink_after = last
    for launch in nodes[: hi + 1]:
        if not is_collective(launch):
            continue
        wait = first_wait(launch)
        in_flight = launch in inside or (wait is not None and pos[wait] >= lo)
        if not in_flight or not is_fsdp_collective(launch):
            continue
        if launch not in inside and wait is not None:  # launched before, completed in or after
            first.prepend(wait)
            placement.moved.append(launch.name)
            continue
        if wait is None:
            placement.left.append(f"{launch.name}: no wait_tensor")
            continue
        if is_all_gather(launch):
            chain = ancestors_within([launch], inside) | {launch}
            reason = _why_not(chain | ({wait} & inside), body, edges, pos, earlier=True)
            if reason is None:
                # after the latest of its inputs that lies in the dense stretch
                inputs = [p for n in chain for p in n.all_input_nodes if p not in chain]
                latest = max(inputs, key=pos.__getitem__, default=None)
                here = latest.next if latest is not None and pos[latest] >= pos[start] else start
                for node in _ordered(chain, pos):
                    here.prepend(node)
                first.prepend(wait)
        else:
            tail = descendants_within(launch, inside) | {launch}
            reason = _why_not(tail, body, edges, pos, earlier=False)
            if reason is None:
                waited = ({wait} | descendants_within(wait, inside)) & tail
                for node in _ordered(tail - waited, pos):
                    sink_after.append(node)
                    sink_after = node
                # before the first of its readers that lies in the dense stretch
                readers = [u for n in tail for u in n.users if u not in tail]
                earliest = min(readers, key=pos.__getitem__, default=None)
                here = earliest if earliest is not None and pos[earliest] < pos[end] else end
                for node in _ordered(waited, pos):
                    here.prepend(node)
        if reason is None:
            placement.moved.append(launch.name)
        else:
            placement.left.append(f"{launch.name}: {reason}")
    if placement.moved or placement.left:
        log.info(
            "place_fsdp_collectives_of: %s (%s): %d FSDP collectives moved out of the span, "
            "%d left: %s",
            region.root,
            region.direction,
            len(placement.moved),
            len(placement.left),
            placement.left,
        )
    return placement


def _why_not(
    moving: set[torch.fx.Node],
    body: set[torch.fx.Node],
    edges: dict[torch.fx.Node, set[torch.fx.Node]],
    pos: dict[torch.fx.Node, int],
    *,
    earlier: bool,
) -> str | None:
    """Why ``moving`` cannot leave the span -- ``earlier``: an all-gather and the span's nodes
    it reads, to before it; else a reduce-scatter and the span's nodes that read it, to after
    it: it holds a node of the region's body, or one that keeps its order."""
    held = _ordered(moving & body, pos)
    if held and earlier:
        return f"it reads {held[0].name!r}, computed inside the region"
    if held:
        return f"the region reads its result in {held[0].name!r}"
    return _pinned(moving, edges, earlier)
