"""``PartitionReport``: what a partition decided, measured on the graphs it produced.

Every number is read off the final forward/backward modules (the forward's extra outputs are
exactly what autograd keeps alive), not off the plan, so the same function measures the
save-all partitioner, torch's min-cut, or any other partition, and they can be compared field by
field. Delivered to an optional callback, logged at DEBUG, and emitted as a
``trace_structured`` artifact so ``tlparse`` shows it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
from ap_tags.counting import count_saved_values
from ap_tags.graph import (
    is_all_gather,
    is_all_gather_output,
    is_collective,
    saved_for_backward,
    storage_nbytes,
)

from ap_partitioner import _compat

log = logging.getLogger(__name__)

ReportCallback = Callable[["PartitionReport"], None]


@dataclass(frozen=True)
class PartitionReport:
    """One partition's outcome.

    ``saved_names``: every value the forward hands the backward (tensors, syms, opaques), in
    forward-output order. Counted with ap-tags' one count (``ap_tags.counting.count_saved``),
    the same the first compilation's and the backend's summaries use:
    ``saved_activation_count`` is the distinct *storages* the saved tensors keep alive, graph
    inputs excluded (saved primals cost nothing extra: the caller holds them anyway; a view of
    a saved tensor costs nothing extra either), ``saved_tensor_count`` the saved activation
    tensors (views counted each), ``saved_storage_bytes`` the bytes per storage (name, bytes).
    ``saved_input_count`` counts the saved tensors whose storage is a graph input. All-gather outputs are activation storages that are an all-gather's result
    (``ap_tags.graph.is_all_gather_output``): keeping one alive means keeping an unsharded weight
    alive. Bytes are storage bytes (symbolic sizes by their hints, 0 when a size has no hint).
    ``backward_collectives`` counts communicating ``_c10d_functional`` ops (waits excluded) the
    backward runs, i.e. collectives re-run there. ``dropped_first_saves`` names the first
    compilation's saves the replay did not keep because the retraced backward never reads them
    (``ap_tags.ReplayedSaves.dropped``: first-partition node names, ``parent[i]`` for a saved
    output of a multi-output op); ``dropped_first_saves_why`` says why each is not kept
    (aligned: the backward reads none of its retraced values, or what the first forward graph
    shows, ``ap_tags.ReplayedSaves.dropped_why``). ``narrowed_first_saves`` names the first
    compilation's saves that are lossless widening casts (a bf16 value's fp32 upcast) the replay
    saved as their narrow source instead (``ap_partitioner._narrow``: the backward recomputes
    the cast bitwise, the forward rounds the source as eager does), by their first-partition
    names; ``narrowed_storages`` the storages saved in their place that the replay would not
    keep otherwise (this graph's names; a source already saved adds none). With an activation budget (``SaveAllPartitioner(
    activation_budget_bytes=...)``): ``budget_bytes``, the graph's ``budget_floor_bytes`` (every
    recomputable save recomputed), ``budget_replay_bytes`` (what the replay alone saves),
    ``recompute_flops`` / ``recompute_bytes_moved`` the recomputation added, and
    ``budget_dropped`` the saves recomputed instead (``name (module fqn)``), best first.
    """

    partitioner: str
    saved_names: tuple[str, ...] = ()
    saved_activation_count: int = 0
    saved_activation_bytes: int = 0
    saved_tensor_count: int = 0
    saved_storage_bytes: tuple[tuple[str, int], ...] = ()
    saved_input_count: int = 0
    saved_all_gather_count: int = 0
    saved_all_gather_bytes: int = 0
    saved_all_gather_names: tuple[str, ...] = ()
    sym_count: int = 0
    opaque_count: int = 0
    backward_collectives: int = 0
    backward_all_gathers: int = 0
    partition_time_s: float = 0.0
    fell_back: bool = False
    fallback_reason: str | None = None
    missing_values: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)
    dropped_first_saves: tuple[str, ...] = ()
    dropped_first_saves_why: tuple[str, ...] = ()
    narrowed_first_saves: tuple[str, ...] = ()
    narrowed_storages: tuple[str, ...] = ()
    budget_bytes: int | None = None
    budget_floor_bytes: int | None = None
    budget_replay_bytes: int | None = None
    recompute_flops: int = 0
    recompute_bytes_moved: int = 0
    budget_dropped: tuple[str, ...] = ()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def _count_collectives(bw_module: fx.GraphModule) -> tuple[int, int]:
    colls = [n for n in bw_module.graph.nodes if is_collective(n)]
    return len(colls), sum(1 for n in colls if is_all_gather(n))


def build_report(
    partitioner: str,
    fw_module: fx.GraphModule,
    bw_module: fx.GraphModule,
    num_fwd_outputs: int,
    **outcome: Any,
) -> PartitionReport:
    """Measure a finished partition (any partitioner's) into a ``PartitionReport``.

    ``outcome`` holds the fields the graphs cannot tell (``partition_time_s``, ``fell_back``,
    ``fallback_reason``, ``missing_values``, ``notes``, ``dropped_first_saves`` and its
    ``_why``, ``narrowed_first_saves``, ``narrowed_storages``); an unknown
    field is a ``TypeError``.
    """
    mod = _compat.partitioners()
    saved = saved_for_backward(fw_module, num_fwd_outputs)
    opaques = [n for n in saved if not mod.is_sym_node(n) and _compat.is_opaque_node(n)]
    opaque_set = set(opaques)  # a set: saved lists run to hundreds of values
    counted = count_saved_values(n for n in saved if n not in opaque_set)
    nodes = {n.name: n for n in fw_module.graph.nodes}
    gathered = [nodes[b] for b in counted.storages if is_all_gather_output(nodes[b])]
    n_coll, n_ag = _count_collectives(bw_module)
    return PartitionReport(
        partitioner=partitioner,
        saved_names=tuple(n.name for n in saved),
        saved_activation_count=counted.storage_count,
        saved_activation_bytes=counted.nbytes,
        saved_tensor_count=counted.tensor_count,
        saved_storage_bytes=tuple(counted.bytes_by_storage().items()),
        saved_input_count=len(counted.inputs),
        saved_all_gather_count=len(gathered),
        saved_all_gather_bytes=storage_nbytes(gathered),
        saved_all_gather_names=tuple(n.name for n in gathered),
        sym_count=counted.symbol_count,
        opaque_count=len(opaques),
        backward_collectives=n_coll,
        backward_all_gathers=n_ag,
        **outcome,
    )


def emit(report: PartitionReport, callback: ReportCallback | None) -> None:
    """Deliver ``report``: DEBUG log, structured-trace artifact, then the user's callback."""
    log.debug("partition report: %s", report)
    _compat.trace_artifact("ap_partition_report", report.to_json)
    if callback is not None:
        callback(report)
