"""Its own lane: token exchanges on a process group of their own, with the same ranks.

Why: a process group runs its collectives in the order they were issued. When the EP token
exchanges share a group with FSDP's all-gathers and reduce-scatters (the zoo's EP models: every
collective on the default group), a parameter all-gather issued after an exchange waits behind
it, and the overlap schedule's early exchange launches would delay the next layer's weights.
:func:`exchange_lane` moves every chunked region's exchange (``all_to_all_single`` of a body) whose
group also carries another collective of the graph to a *lane*: a group with the same ranks,
created once per process and group (``torch.distributed.new_group``). The ranks and the data are
the same, so every value is the same; only the queue differs.

``new_group`` is collective over the default group: every rank must compile the same graphs in
the same order, as SPMD training does (one lane per group and process, reused afterwards).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch.distributed as dist
import torch.fx
from ap_tags.checks import require_graph_module
from ap_tags.graph import is_collective

from ._compat import process_group_of
from ._region_collectives import is_all_to_all
from ._schedule_regions import chunked_regions

log = logging.getLogger(__name__)

#: group name -> the name of its lane, per process (a lane is made once and reused)
_LANES: dict[str, str] = {}


@dataclass
class LaneReport:
    """What :func:`exchange_lane` did: ``lanes`` maps each shared group to its lane's name,
    ``exchanges_moved`` counts the exchanges now on a lane, ``reason`` says why nothing moved."""

    lanes: dict[str, str] = field(default_factory=dict)
    exchanges_moved: int = 0
    reason: str | None = None


def _group_arg(node: torch.fx.Node) -> str | None:
    """The ``group_name`` a functional collective runs on (its last argument)."""
    if "group_name" in node.kwargs:
        return str(node.kwargs["group_name"])
    return str(node.args[-1]) if node.args and isinstance(node.args[-1], str) else None


def _set_group(node: torch.fx.Node, name: str) -> None:
    if "group_name" in node.kwargs:
        node.kwargs = {**node.kwargs, "group_name": name}
    else:
        node.args = (*node.args[:-1], name)


def lane_for(group_name: str) -> str:
    """The lane of ``group_name``: a group with the same ranks, made on first use."""
    cached = _LANES.get(group_name)
    if cached is not None:
        try:
            process_group_of(cached)  # a lane of an earlier, destroyed world does not resolve
        except Exception:  # noqa: BLE001 - any failure to resolve means: make a new one
            cached = None
    if cached is None:
        ranks = dist.get_process_group_ranks(process_group_of(group_name))
        lane = dist.new_group(ranks=ranks)
        if not isinstance(lane, dist.ProcessGroup):  # this rank is not in its own group's ranks
            raise RuntimeError(f"exchange_lane: no lane for group {group_name!r} on this rank")
        _LANES[group_name] = str(lane.group_name)
        log.info(
            "exchange_lane: group %s (ranks %s) -> lane %s", group_name, ranks, _LANES[group_name]
        )
    return _LANES[group_name]


def shared_groups(graph: torch.fx.Graph, exchanges: list[torch.fx.Node]) -> set[str]:
    """The exchanges' groups that another collective of the graph also runs on."""
    mine = set(exchanges)
    others = {
        _group_arg(n)
        for n in graph.nodes
        if n.op == "call_function" and is_collective(n) and n not in mine
    }
    return {g for g in (_group_arg(x) for x in exchanges) if g is not None and g in others}


def exchange_lane(gm: torch.fx.GraphModule) -> LaneReport:
    """Move the chunked regions' token exchanges that share a process group with another
    collective onto a lane of their own (module doc). Needs ``torch.distributed`` initialised
    when anything moves."""
    require_graph_module(gm, where="exchange_lane")
    exchanges = [
        x
        for region in chunked_regions(gm.graph)
        for chunk in sorted(region.chunks)
        for x in region.exchanges(chunk)
        if is_all_to_all(x)
    ]
    report = LaneReport()
    if not exchanges:
        report.reason = "no token exchange in a chunked region"
        return report
    shared = shared_groups(gm.graph, exchanges)
    if not shared:
        report.reason = "no exchange shares a process group with another collective"
        return report
    if not dist.is_available() or not dist.is_initialized():
        report.reason = "torch.distributed is not initialised: no lane can be made"
        return report
    report.lanes = {g: lane_for(g) for g in sorted(shared)}
    for x in exchanges:
        group = _group_arg(x)
        if group in report.lanes:
            _set_group(x, report.lanes[group])
            report.exchanges_moved += 1
    gm.recompile()
    return report
