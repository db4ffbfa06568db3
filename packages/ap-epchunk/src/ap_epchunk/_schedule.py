"""``schedule_chunk_overlap``: hide one chunk's token exchange under another chunk's compute.

:func:`ap_epchunk.chunk_pass` leaves each chunked region with its N chunk copies interleaved
node by node, so chunk 0's and chunk 1's exchange ``k`` are launched together and both are
waited on before either chunk computes on: nothing runs while an exchange is in flight. This
pass reorders every chunked region that meets the contract
(:mod:`ap_epchunk._schedule_regions`) into a pipeline (:mod:`ap_epchunk._schedule_order`): the
exchanges of chunks ``c+1 ..`` are in flight while chunk ``c`` computes, forward and backward,
for any N >= 2. It only permutes nodes inside each region's span along the graph's own
dependencies (plus the order of mutations and random ops), so every value is bitwise the one
the unscheduled graph computes. A region that breaks the contract is left as it is, with the
reason in the report; a failure while applying restores the graph's original order.

Where it runs and what keeps the order downstream (torch 2.15):

* ``autoparallel_backend(ep_chunk=ChunkConfig(..., schedule_overlap=True))`` runs it on the
  joint graph right after ``chunk_pass`` and concretization, before partitioning: the
  partitioner extracts the forward in joint-graph order, and its autograd-order epilogue
  (``reordering_to_mimic_autograd_engine``) re-inserts backward nodes in joint-graph order too,
  pulling in only the forward nodes each one needs. A forward or backward graph run as FX (no
  Inductor codegen) therefore runs exactly this order.
* Inductor lowers each graph in FX order; an ``all_to_all_single`` becomes a collective kernel
  launched asynchronously and its ``wait_tensor`` a separate wait kernel. Its scheduler then
  fuses and, with ``reorder_for_peak_memory`` (on by default), replaces the order by another
  topological order when that has a lower estimated peak -- which regroups a scheduled forward
  (measured on Qwen3-MoE at N=2, ``benchmarks.ep_overlap --inductor-order``: chunk 1's
  split-size chain after chunk 0's experts). With it off, the generated code keeps this order,
  so the backend turns it off when it schedules. ``enable_simple_overlap`` (2.14+, on by
  default) moves launches earlier and waits later (this schedule's direction);
  ``reorder_for_compute_comm_overlap`` is off by default. The hard ordering hook,
  ``torch.ops.higher_order.control_deps`` (``overlap_scheduling``'s manual scheduling inserts
  it on post-grad graphs, ``fx_passes/control_dependencies.preserve_node_ordering``), is not
  used: the joint graph is retraced by the partitioner.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch.fx
from ap_tags.checks import require_bool, require_graph_module

from ._fsdp_placement import RegionPlacement, place_fsdp_collectives_of
from ._schedule_order import pipeline_order
from ._schedule_regions import (
    ChunkedRegion,
    chunked_regions,
    contract_violation,
    first_wait,
    is_compute,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegionSchedule:
    """What the scheduler did to one chunked region.

    * ``exchanges_paired``: exchange positions ``k`` launched as a pipeline over all chunks
      (``all_to_all_single`` per chunk; 0 for a region left unscheduled);
    * ``filler_moved``: compute nodes now between an exchange's launch and its wait that were
      not between any before;
    * ``exposed_before`` / ``exposed_after``: exchanges with no compute node between launch and
      wait, before and after scheduling;
    * ``reason``: why the region was left unscheduled (None when scheduled);
    * ``fsdp_moved``: FSDP all-gathers / reduce-scatters that were in flight inside the region's
      span and now sit in the dense stretch around it (``place_fsdp_collectives``);
    * ``fsdp_left``: ``"name: reason"`` of those a dependency kept inside.
    """

    root: str
    backward: bool
    num_chunks: int
    exchanges_paired: int = 0
    filler_moved: int = 0
    exposed_before: int = 0
    exposed_after: int = 0
    reason: str | None = None
    fsdp_moved: int = 0
    fsdp_left: tuple[str, ...] = ()


@dataclass
class ScheduleReport:
    """What :func:`ap_epchunk.schedule_chunk_overlap` did, per chunked region with token
    exchanges (a region without any, such as forward nodes a backward graph recomputes, has
    nothing to overlap and is not listed)."""

    regions: list[RegionSchedule] = field(default_factory=list)

    @property
    def scheduled(self) -> list[RegionSchedule]:
        return [r for r in self.regions if r.reason is None]

    @property
    def refused(self) -> list[RegionSchedule]:
        return [r for r in self.regions if r.reason is not None]


def _window(region: ChunkedRegion, graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """Every node from the region's first body node to its last, in graph order."""
    body = set(region.body())
    nodes = list(graph.nodes)
    first = next(i for i, n in enumerate(nodes) if n in body)
    last = max(i for i, n in enumerate(nodes) if n in body)
    return nodes[first : last + 1]


def _hiding(
    order: list[torch.fx.Node], launches: list[torch.fx.Node]
) -> dict[torch.fx.Node, set[torch.fx.Node]]:
    """Per exchange: the compute nodes between its launch and its wait in ``order``."""
    pos = {n: i for i, n in enumerate(order)}
    out: dict[torch.fx.Node, set[torch.fx.Node]] = {}
    for x in launches:
        wait = first_wait(x)
        end = pos.get(wait, len(order)) if wait is not None else len(order)
        out[x] = {n for n in order[pos[x] + 1 : end] if is_compute(n)}
    return out


def _launches(region: ChunkedRegion) -> list[torch.fx.Node]:
    return [x for c in sorted(region.chunks) for x in region.exchanges(c)]


def _move(window: list[torch.fx.Node], order: list[torch.fx.Node]) -> None:
    """Put ``order`` (a permutation of the contiguous ``window``) where ``window`` was."""
    anchor = window[0].prev
    for node in order:
        anchor.append(node)
        anchor = node


def _place_all(graph: torch.fx.Graph) -> dict[tuple[str, bool], RegionPlacement]:
    """FSDP collectives out of every span with exchanges, region by region, before any
    region is scheduled (:mod:`ap_epchunk._fsdp_placement`)."""
    placed: dict[tuple[str, bool], RegionPlacement] = {}
    for region in chunked_regions(graph):
        if _launches(region):
            placed[(region.root, region.backward)] = place_fsdp_collectives_of(graph, region)
    return placed


def schedule_chunk_overlap(
    gm: torch.fx.GraphModule, *, strict: bool = False, place_fsdp_collectives: bool = True
) -> ScheduleReport:
    """Reorder every chunked region of ``gm`` into a pipeline of its N chunks (module doc).

    ``place_fsdp_collectives`` (default on): first move the FSDP all-gathers and
    reduce-scatters in flight inside a region's span to the dense stretch around it
    (:mod:`ap_epchunk._fsdp_placement`), so they do not compete with its exchanges; per region
    ``fsdp_moved`` / ``fsdp_left`` report it. ``strict=True`` raises ``ValueError`` naming the
    region and the reason instead of leaving a region that breaks the contract unscheduled
    (the graph is then unchanged).
    """
    require_graph_module(gm, where="schedule_chunk_overlap")
    require_bool(strict, where="schedule_chunk_overlap", arg="strict")
    require_bool(
        place_fsdp_collectives, where="schedule_chunk_overlap", arg="place_fsdp_collectives"
    )
    graph = gm.graph
    original = list(graph.nodes)
    try:
        placed = _place_all(graph) if place_fsdp_collectives else {}
        report, plans = _plan_regions(graph, placed, strict)
        for window, order in plans:
            _move(window, order)
        graph.lint()
    except Exception:
        _move(list(graph.nodes), original)
        raise
    gm.recompile()
    log.info(
        "schedule_chunk_overlap: %d regions scheduled, %d left unscheduled, %d FSDP collectives "
        "moved out of region spans",
        len(report.scheduled),
        len(report.refused),
        sum(r.fsdp_moved for r in report.regions),
    )
    return report


def _plan_regions(
    graph: torch.fx.Graph, placed: dict[tuple[str, bool], RegionPlacement], strict: bool
) -> tuple[ScheduleReport, list[tuple[list[torch.fx.Node], list[torch.fx.Node]]]]:
    """The report and, per region that meets the contract, ``(window, its pipelined order)``."""
    report = ScheduleReport()
    plans: list[tuple[list[torch.fx.Node], list[torch.fx.Node]]] = []
    for region in chunked_regions(graph):
        n = len(region.chunks)
        launches = _launches(region)
        if not launches:
            # nothing to overlap (e.g. a forward region a backward graph recomputes)
            log.debug(
                "schedule_chunk_overlap: %s (%s) has no exchange", region.root, region.direction
            )
            continue
        placement = placed.get((region.root, region.backward), RegionPlacement())
        fsdp_moved, fsdp_left = len(placement.moved), tuple(placement.left)
        window = _window(region, graph)
        before = _hiding(window, launches)
        exposed_before = sum(1 for x in launches if not before[x])
        reason = contract_violation(region, set(window))
        order: list[torch.fx.Node] = []
        if reason is None:
            try:
                order = pipeline_order(window, region)
            except RuntimeError as exc:
                reason = str(exc)
        if reason is not None:
            if strict:
                raise ValueError(
                    f"schedule_chunk_overlap: region {region.root!r} ({region.direction}) "
                    f"left unscheduled: {reason}"
                )
            log.info(
                "schedule_chunk_overlap: %s (%s) unscheduled: %s",
                region.root,
                region.direction,
                reason,
            )
            report.regions.append(
                RegionSchedule(
                    region.root,
                    region.backward,
                    n,
                    exposed_before=exposed_before,
                    exposed_after=exposed_before,
                    reason=reason,
                    fsdp_moved=fsdp_moved,
                    fsdp_left=fsdp_left,
                )
            )
            continue
        after = _hiding(order, launches)
        hidden_before = set().union(*before.values()) if before else set()
        moved = set().union(*after.values()) - hidden_before if after else set()
        report.regions.append(
            RegionSchedule(
                region.root,
                region.backward,
                n,
                exchanges_paired=len(launches) // n,
                filler_moved=len(moved),
                exposed_before=exposed_before,
                exposed_after=sum(1 for x in launches if not after[x]),
                fsdp_moved=fsdp_moved,
                fsdp_left=fsdp_left,
            )
        )
        plans.append((window, order))
    return report, plans
