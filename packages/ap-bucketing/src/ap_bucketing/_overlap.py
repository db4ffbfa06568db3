"""``OverlapBucketingPass``: FSDP pre-bucketing + overlap scheduling under ap-bucketing's rules.

A ``CustomGraphPass`` a trainer sets as ``torch._inductor.config.post_grad_custom_post_pass``
(directly, or through ``compile_fx(config_patches=overlap_config_patches(cfg))`` so it also
reaches the lazily compiled backward). Each run enters ``patched(config)`` itself, so the forward
*and* the backward graph are bucketed with the same config even though the backward compiles
long after the forward's compile call returned. Its ``uuid()`` covers the config, the pass
options and this package's source, so Inductor's FX-graph cache keys on all of them.

On a machine without a GPU, ``cpu=True`` (the default there) swaps the GPU-only estimators for
analytical ones (``_cpu_estimation``): ``compute_estimator="analytical"``, no fusion regions, a
custom runtime estimation, and a scoped replacement of
``overlap_scheduling.estimate_roofline_runtime_ms``.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Hashable
from typing import Any

import torch.fx as fx

from . import _compat
from ._checks import require_bool, require_instance
from ._coalesced import bucket_coalesced, pack_shards_op
from ._coalesced import cap_fn as coalesced_cap_fn
from ._config import COALESCED, BucketingConfig, resolve_config
from ._contiguous import contiguous_bucket_inputs
from ._cpu_estimation import cpu_overlap_estimators, cpu_runtime_estimation, default_cpu
from ._estimation_log import estimation_log_only_when_traced
from ._groups import primary_fsdp_groups
from ._hazards import (
    HazardCycle,
    fill_edges,
    hazard_edges,
    pull_up_fills,
    reads_written_storage,
    restore_order,
    sink_allocations,
    storage_roots,
    written_storages,
)
from ._metrics import max_consec_compute_between_rs
from ._patching import excluding, only_groups, patched
from ._prefetch import (
    chains,
    fsdp_candidates,
    hoist_issues,
    pull_up_reduce_scatter_waits,
    window_edges,
)
from ._replicate import (
    bucket_gradient_all_reduces,
    fsdp_groups_for,
    gradient_all_reduce_waits,
)
from ._rollback import checkpoint, restore, unsortable_nodes
from ._shard_casts import cast_shards_op
from ._sizes import collective_bytes
from ._source import package_source_hash
from ._waits import merge_duplicate_waits

log = logging.getLogger(__name__)

# Tighter than torch's defaults (5 GB in flight, distance 200): overlap may then keep fewer
# unsharded weights and unreduced gradients alive at once.
_DEFAULT_SCHEDULE: dict[str, object] = {"max_in_flight_gb": 2.0, "max_coll_distance": 100}


class OverlapBucketingPass(_compat.CustomGraphPass):
    """Post-grad pass: ap-bucketing FSDP pre-bucketing, then (``reorder=True``) torch's
    overlap scheduler, all under ``patched(config)``.

    Args:
        config: bucketing rules; ``BucketingConfig()`` when omitted.
        cpu: use analytical estimators (no GPU needed); default: no CUDA available.
        reorder: ``True`` runs torch's overlap scheduler; ``"prefetch"`` ap's own FSDP
            schedule: each bucket's all-gather issued right after the previous bucket's wait
            (``config.prefetch_depth`` ahead), each reduce-scatter waited before the next is
            issued, nothing else moved (no cost model: FSDP2's and torchtitan graph_trainer's
            order; what a graph executed in its own order wants); ``False`` only
            pre-buckets FSDP collectives.
        **schedule_overrides: extra keyword arguments for torch's
            ``schedule_overlap_bucketing`` (plain values; they are part of ``uuid()``).
    """

    def __init__(
        self,
        config: BucketingConfig | None = None,
        *,
        cpu: bool | None = None,
        reorder: bool | str = True,
        **schedule_overrides: object,
    ) -> None:
        self.config = resolve_config(config, where=_PASS)
        self.cpu = default_cpu() if cpu is None else require_bool(cpu, where=_PASS, arg="cpu")
        if not isinstance(reorder, bool) and reorder != PREFETCH:
            raise TypeError(
                f"{_PASS}: reorder must be a bool or {PREFETCH!r}, got {reorder!r} "
                f"({type(reorder).__name__})"
            )
        self.reorder: bool | str = reorder
        if reorder is True and self.config.bucket_mode == COALESCED:
            raise ValueError(
                f"{_PASS}: bucket_mode={COALESCED!r} with reorder=True: a coalesced bucket "
                "has one wait per member, behind a getitem; torch 2.11's overlap scheduler "
                "takes one wait per collective, and torch 2.15.0's, which pairs them, fails "
                "when it forces an earlier bucket's wait before that wait's getitem is "
                "scheduled ('has unscheduled input nodes'); use "
                f"reorder={PREFETCH!r} (ap's FSDP schedule) or reorder=False"
            )
        if self.config.bucket_mode == COALESCED:
            # registered now, not when the pass first buckets: a warm FX-graph cache serves
            # the compiled code that calls it without running this pass (the restarted job
            # failed with "no attribute 'pack_shards'")
            pack_shards_op()
            cast_shards_op()
        _check_schedule_overrides(schedule_overrides)
        self.schedule_overrides: dict[str, object] = dict(schedule_overrides)
        self.reports: list[dict[str, object]] = []

    def schedule_kwargs(self) -> dict[str, object]:
        """The keyword arguments handed to ``schedule_overlap_bucketing``."""
        kwargs: dict[str, object] = dict(_DEFAULT_SCHEDULE)
        kwargs["max_compute_pre_fetch"] = self.config.max_compute_pre_fetch
        kwargs["pre_bucketing_fsdp_collectives"] = True
        kwargs["pre_bucketing_fsdp_collectives_bucket_cap_mb"] = self.config.bucket_cap_mb
        kwargs["bucket_mode"] = self.config.bucket_mode
        if self.cpu:
            kwargs["compute_estimator"] = "analytical"
            kwargs["enable_fusion_regions"] = False
            kwargs["custom_runtime_estimation"] = cpu_runtime_estimation
        kwargs.update(self.schedule_overrides)
        return kwargs

    def __call__(self, graph: fx.Graph) -> None:
        require_instance(graph, fx.Graph, where=_PASS, arg="graph", expected="a torch.fx.Graph")
        gm = graph.owning_module
        if not isinstance(gm, fx.GraphModule):
            raise ValueError(f"{_PASS}: graph must be owned by a GraphModule, got {gm!r}")
        wait = _compat.wait_tensor_op()
        if not graph.find_nodes(op="call_function", target=wait):
            return
        _check_sizable(graph)  # refuse before torch's passes start mutating the graph
        if self.reorder is True and self.config.bucket_mode == "default":
            _compat.require_default_mode_reordering()
        before = max_consec_compute_between_rs(graph)
        counts_before = collective_counts(graph)
        saved = checkpoint(graph)
        merged_waits = merge_duplicate_waits(graph)  # torch's bucketers assume one per collective
        made_contiguous = contiguous_bucket_inputs(graph)  # torch 2.11/2.12 pack with view
        skipped: str | None = None
        excluded: list[str] = []
        try:
            moved, replicate_merged, excluded = self._bucket_and_schedule(gm)
        except AssertionError as exc:
            if _compat.REGION_SORT_FAILURE not in str(exc):
                raise
            stuck = [n.name for n in unsortable_nodes(graph) if n.op != "output"]
            restore(graph, saved)
            moved = replicate_merged = 0
            where = f"a cycle through {', '.join(stuck[:4])}" if stuck else "no cycle left"
            skipped = (
                f"torch's bucketing could not reorder a merged bucket's region ({exc}; "
                f"torchtitan#4047; {where}): graph left unbucketed"
            )
            log.warning("%s: %s", _PASS, skipped)
        except HazardCycle as exc:
            restore(graph, saved)
            moved = replicate_merged = 0
            skipped = f"{exc}: graph left unbucketed and in its original order"
            log.warning("%s: %s", _PASS, skipped)
        after = max_consec_compute_between_rs(graph)
        counts_after = collective_counts(graph)
        counts = {kind: (count, counts_after[kind]) for kind, count in counts_before.items()}
        self.reports.append(
            {
                "max_consec_compute_between_rs": (before, after),
                "hazard_reorders": moved,
                "unbucketed_reading_written_storage": excluded,
                "replicate_all_reduces_merged": replicate_merged,
                "skipped": skipped,
                "collectives": counts,
                "duplicate_waits_merged": merged_waits,
                "contiguous_inputs": made_contiguous,
            }
        )
        log.info(
            "OverlapBucketingPass: %s; max_consec_compute_between_rs %d -> %d (reorder=%s, "
            "cpu=%s, nodes moved back into in-place write order: %d)",
            ", ".join(f"{kind} {b} -> {a}" for kind, (b, a) in counts.items()),
            before,
            after,
            self.reorder,
            self.cpu,
            moved,
        )

    def _bucket_and_schedule(self, gm: fx.GraphModule) -> tuple[int, int, list[str]]:
        """Torch's FSDP pre-bucketing (+ replicate all-reduces), then scheduling or a sort;
        ``(nodes moved back into write order, replicate all-reduces merged, collectives left
        unbucketed because they read a storage written in place)``.

        Both reorderings and torch's merge see data edges only: the in-place write order
        (``_hazards.py``) is recorded on the graph as given -- its order is its meaning --
        and on the merged graph for the nodes the merge added (the ``"custom_ops"`` unpack's
        ``out=`` copies), then restored after scheduling; a contradiction raises
        ``HazardCycle`` and the caller restores the original graph."""
        graph = gm.graph
        replicate_merged = 0
        original = set(graph.nodes)
        edges = hazard_edges(graph)
        excluded = _reading_written_storage(graph)
        window_groups: set[Hashable] = set()
        candidates: set[fx.Node] = set()
        with (
            patched(self.config),
            cpu_overlap_estimators(self.cpu),
            estimation_log_only_when_traced(),
            excluding(excluded),
        ):
            kwargs = self.schedule_kwargs()
            pre_bucket = _compat.pre_bucket_fsdp_collectives()
            if kwargs.pop("pre_bucketing_fsdp_collectives"):
                fsdp_groups = fsdp_groups_for(gm, self.config)  # before merging changes counts
                window_groups = fsdp_groups
                candidates = fsdp_candidates(graph, fsdp_groups)
                # before pre-bucketing packs their consumers (reduce-scatters) into buckets
                gradient_waits = {
                    w
                    for w in gradient_all_reduce_waits(gm, fsdp_groups)
                    if w.args[0] not in excluded
                }
                # torch identifies the FSDP groups, then buckets every FSDP-shaped all-gather
                # and reduce-scatter of the graph: keep another mesh dim's (TP) out of it
                cap_override = kwargs.pop("pre_bucketing_fsdp_collectives_bucket_cap_mb")
                if self.config.bucket_mode == COALESCED:
                    # ap's own copy-free form (_coalesced.py); torch's scheduler below sees
                    # the coalesced collectives and no merge of its own
                    group_size = primary_fsdp_groups(gm)[1]
                    cap = coalesced_cap_fn(self.config, group_size)
                    bucket_coalesced(gm, self.config, set(fsdp_groups), cap, excluded)
                    kwargs["bucket_mode"] = "custom_ops"
                else:
                    with only_groups(fsdp_groups):
                        pre_bucket(gm, bucket_cap_mb=cap_override, mode=kwargs["bucket_mode"])
                # torch buckets all-reduces of the FSDP groups only: HSDP's replicate group
                replicate_merged = bucket_gradient_all_reduces(
                    gm, fsdp_groups, self.config, gradient_waits
                )
            if self.reorder is True:
                schedule = _compat.schedule_overlap_bucketing()
                kwargs["pre_bucketing_fsdp_collectives"] = False  # done above
                _supported_by(schedule, kwargs)
                schedule(gm, **kwargs)
            else:
                # Merging leaves consumers of early members ahead of the merged collective;
                # the scheduler would reorder them, so without it sort here.
                _compat.stable_topological_sort(graph)
            # the merges' own writes (pre-bucketing's and the scheduler's: it buckets too): a
            # "custom_ops" bucket's members are filled by an out= copy their readers have no
            # edge to
            fills = fill_edges(graph, original)
            moved = pull_up_fills(graph, fills, original)
            edges += fills
            moved += self._restore_with_window(graph, edges, original, candidates, window_groups)
            moved += sink_allocations(graph, original)
        return moved, replicate_merged, sorted(n.name for n in excluded)

    def _restore_with_window(
        self,
        graph: fx.Graph,
        edges: list[tuple[fx.Node, fx.Node]],
        original: set[fx.Node],
        candidates: set[fx.Node],
        groups: set[Hashable],
    ) -> int:
        """The write order (``edges``) and the prefetch window restored together; a window
        that contradicts the write order is dropped with a warning (never the write order)."""
        depth = self.config.prefetch_depth
        if depth is None and self.reorder == PREFETCH:
            depth = 1
        if depth is None or not groups:
            return restore_order(graph, edges)
        chain_list = chains(graph, original, candidates, groups)
        pulled = pull_up_reduce_scatter_waits(graph, chain_list, original, depth)
        if self.reorder == PREFETCH:
            pulled += hoist_issues(graph, chain_list, original, depth)
        window = window_edges(chain_list, original, depth)
        try:
            return restore_order(graph, edges + window) + pulled
        except HazardCycle as exc:
            log.warning("%s: prefetch window dropped: %s", _PASS, exc)
            return restore_order(graph, edges) + pulled

    def uuid(self) -> str:
        """Changes whenever the config, the pass options or this package's code change."""
        overrides = ",".join(
            f"{k}={_stable_repr(v)}" for k, v in sorted(self.schedule_overrides.items())
        )
        text = (
            f"{type(self).__qualname__}|{self.config.fingerprint()}|cpu={self.cpu}|"
            f"reorder={self.reorder}|{overrides}|{package_source_hash()}"
        )
        return hashlib.sha256(text.encode()).hexdigest()


_PASS = "OverlapBucketingPass"
#: ``OverlapBucketingPass(reorder=PREFETCH)``: ap's own FSDP prefetch schedule
PREFETCH = "prefetch"


def collective_counts(graph: fx.Graph) -> dict[str, int]:
    """Functional collectives issued by ``graph``, by kind (the ``_out`` all-gather counted
    with the plain one): what a bucketing pass reduces, reported before and after it."""
    kinds = {
        "all_gather": (
            "all_gather_into_tensor",
            "all_gather_into_tensor_out",
            "all_gather_into_tensor_coalesced",
        ),
        "reduce_scatter": ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"),
        "all_reduce": ("all_reduce",),
    }
    return {
        kind: sum(
            len(graph.find_nodes(op="call_function", target=op)) for op in _compat.c10d_ops(*ops)
        )
        for kind, ops in kinds.items()
    }


def _supported_by(schedule: Any, kwargs: dict[str, object]) -> None:
    """Drop from ``kwargs`` this pass's own defaults that ``schedule`` does not take (torch
    2.11's scheduler has no ``compute_estimator`` or ``bucket_mode``, 2.11/2.12's no
    ``pre_bucketing_fsdp_collectives``: those never pre-bucket inside the scheduler). User
    overrides were checked against it already."""
    import inspect

    accepted = set(inspect.signature(schedule).parameters)
    dropped = sorted(k for k in kwargs if k not in accepted)
    for name in dropped:
        del kwargs[name]
    if dropped:
        log.debug("%s: torch's schedule_overlap_bucketing takes no %s", _PASS, dropped)


def _check_schedule_overrides(overrides: dict[str, object]) -> None:
    """Unknown scheduler options fail here, naming the option, not deep inside a compile."""
    import inspect

    schedule = _compat.schedule_overlap_bucketing()
    accepted = set(inspect.signature(schedule).parameters) - {"gm"}
    for name in overrides:
        if name not in accepted:
            raise TypeError(
                f"{_PASS}: {name!r} is not an option of torch's schedule_overlap_bucketing "
                f"(accepted: {', '.join(sorted(accepted))})"
            )


def _reading_written_storage(graph: fx.Graph) -> set[fx.Node]:
    """The collectives that read, directly or through the single-input chain torch's merge
    absorbs into a bucket's pack (a parameter's cast), a storage the graph writes in place:
    bucketed, the pack would read it at another point of the write order."""
    written = written_storages(graph)
    if not written:
        return set()
    roots = storage_roots(graph)
    found: set[fx.Node] = set()
    for target in _compat.sizable_collective_ops():
        for coll in graph.find_nodes(op="call_function", target=target):
            node = coll
            for _ in range(_CHAIN_LIMIT):
                if reads_written_storage(node, roots, written):
                    found.add(coll)
                    break
                inputs = node.all_input_nodes
                if len(inputs) != 1:
                    break
                node = inputs[0]
    if found:
        log.info(
            "%s: %d collectives read a storage the graph writes in place; left unbucketed: %s",
            _PASS,
            len(found),
            ", ".join(sorted(n.name for n in found)[:8]),
        )
    return found


_CHAIN_LIMIT = 16


def _check_sizable(graph: fx.Graph) -> None:
    """Every collective torch's bucketing may size has tensor ``meta['val']`` on itself and its
    input; otherwise raise ``MissingValueError`` naming it while the graph is still untouched
    (torch merges all-gathers before it looks at reduce-scatters)."""
    for target in _compat.sizable_collective_ops():
        for node in graph.find_nodes(op="call_function", target=target):
            collective_bytes(node)


def _stable_repr(value: object) -> str:
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
    return repr(value)


def overlap_config_patches(
    config: BucketingConfig | None = None,
    *,
    cpu: bool | None = None,
    reorder: bool | str = True,
    **schedule_overrides: object,
) -> dict[str, object]:
    """Inductor config patches that enable ap-bucketing + overlap scheduling on this device.

    Pass them as ``compile_fx(..., config_patches=...)``: compile_fx re-applies them around the
    lazily compiled backward, and the pass inside patches torch only while it runs, so both
    graphs are bucketed under ``config`` without any process-wide ``install``. Torch's built-in
    overlap scheduling is switched off so the graph is not scheduled twice.
    """
    cfg = resolve_config(config, where="overlap_config_patches")
    bucketing_pass = OverlapBucketingPass(cfg, cpu=cpu, reorder=reorder, **schedule_overrides)
    return {
        "post_grad_custom_post_pass": bucketing_pass,
        "aten_distributed_optimizations.enable_overlap_scheduling": False,
    }
