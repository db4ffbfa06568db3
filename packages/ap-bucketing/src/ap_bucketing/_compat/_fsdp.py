"""torch's FSDP pre-bucketing, bucketing and overlap-scheduling functions ap-bucketing builds
on: whether this torch has pre-bucketing (2.13+) and, where it predates it, the pieces carried
from torch 2.15; the cap torch sizes buckets with; how torch packs a bucket's inputs.

Part of the compat seam (:mod:`ap_bucketing._compat`): every private torch name is looked
up at call time, through :func:`~ap_bucketing._compat._support.attr` and
:func:`~ap_bucketing._compat._support.module`."""

from __future__ import annotations

from typing import Any

import torch

from ap_bucketing import _carried

from ._support import _ABSENT, BUCKETING_MODULE, FSDP_MODULE, OVERLAP_MODULE, attr, missing, module

#: The first torch whose Inductor has FSDP pre-bucketing (``fsdp.identify_fsdp_groups`` and
#: ``fsdp.pre_bucket_fsdp_collectives``, the sites ``install``/``patched`` and
#: ``OverlapBucketingPass`` build on); 2.11 and 2.12 have neither.
FSDP_PREBUCKETING_SINCE = "2.13"


def predates_fsdp_prebucketing() -> bool:
    """This torch's Inductor predates FSDP pre-bucketing: it has neither
    ``fsdp.identify_fsdp_groups`` nor ``fsdp.pre_bucket_fsdp_collectives`` (2.11, 2.12; see
    :data:`FSDP_PREBUCKETING_SINCE`). A torch with only one of them is a changed torch, and the
    missing one raises the package's error."""
    fsdp = module(FSDP_MODULE)
    return not any(
        hasattr(fsdp, n) for n in ("identify_fsdp_groups", "pre_bucket_fsdp_collectives")
    )


def require_default_mode_reordering() -> None:
    """Refuse ``bucket_mode="default"`` with reordering on a torch that predates FSDP
    pre-bucketing: measured on torch 2.11.0 (CPU), the carried pre-bucketing's default-mode
    buckets, once torch's scheduler reorders them, gave NaN results (ap-bucketing's
    ``test_hsdp`` / ``test_region_sort`` default-mode cases); ``"custom_ops"``, the default,
    matches bitwise there. Raises this package's error naming the mode and the first torch
    whose own pre-bucketing it is tested with."""
    if predates_fsdp_prebucketing():
        raise missing(
            f"{FSDP_MODULE}.pre_bucket_fsdp_collectives for bucket_mode='default' with reordering "
            f"(first in torch {FSDP_PREBUCKETING_SINCE}; on this torch use bucket_mode="
            "'custom_ops', the default, or reorder=False)"
        )


def _prebucketing_attr(name: str) -> Any:
    """``fsdp.<name>`` of FSDP pre-bucketing, or the error naming the feature and the first
    torch that has it."""
    found = getattr(module(FSDP_MODULE), name, _ABSENT)
    if found is _ABSENT:
        raise missing(
            f"{FSDP_MODULE}.{name} (Inductor's FSDP pre-bucketing, which ap-bucketing's "
            f"install/patched/OverlapBucketingPass build on; first in torch "
            f"{FSDP_PREBUCKETING_SINCE}. bucket_collectives, primary_fsdp_groups and "
            "max_consec_compute_between_rs work on this torch)"
        )
    return found


def fsdp_all_gather_helpers() -> tuple[Any, Any, Any]:
    """torch's own FSDP helpers ``(is_fsdp_all_gather, _get_group_name,
    _get_group_size_from_node)``, so ap-bucketing and torch agree on what "FSDP" means."""
    names = ("is_fsdp_all_gather", "_get_group_name", "_get_group_size_from_node")
    if predates_fsdp_prebucketing():  # 2.11/2.12: carried where missing (2.12 has the first)
        fsdp = module(FSDP_MODULE)
        carried = (
            _carried.is_fsdp_all_gather,
            _carried.get_group_name,
            _carried.get_group_size_from_node,
        )
        is_fsdp, group_name, group_size = (
            getattr(fsdp, n, c) for n, c in zip(names, carried, strict=True)
        )
    else:
        is_fsdp, group_name, group_size = (attr(FSDP_MODULE, n) for n in names)
    return is_fsdp, group_name, group_size


def fsdp_reduce_scatter_wait_predicate() -> Any:
    """torch's ``fsdp.is_fsdp_reduce_scatter_wait``: the reduce-scatter's wait flows to the
    graph's outputs through single-input ops only (a gradient going out unchanged). The same
    predicate torch's FSDP reduce-scatter bucketing filters on (on a torch that predates FSDP
    pre-bucketing, 2.15's, which the carried pre-bucketing filters on)."""
    if predates_fsdp_prebucketing():
        return _carried.is_fsdp_reduce_scatter_wait
    return attr(FSDP_MODULE, "is_fsdp_reduce_scatter_wait")


def all_reduce_bucketing() -> tuple[Any, Any, Any]:
    """torch's all-reduce bucketing pieces ``(is_all_reduce_tensor, _ar_group_key,
    merge_all_reduce_bucket)``: the filter and key its ``bucket_all_reduce_by_mb`` hands the
    greedy bucketer, and the merge its FSDP all-reduce bucketing applies to each bucket."""
    names = ("is_all_reduce_tensor", "_ar_group_key", "merge_all_reduce_bucket")
    is_all_reduce, group_key, merge = (attr(BUCKETING_MODULE, n) for n in names)
    return is_all_reduce, group_key, merge


def is_compute_node_predicate() -> Any:
    """``overlap_scheduling.is_compute_node``: an op with a flop formula."""
    return attr(OVERLAP_MODULE, "is_compute_node")


def schedule_overlap_bucketing() -> Any:
    """``overlap_scheduling.schedule_overlap_bucketing``: FSDP pre-bucketing + scheduling."""
    return attr(OVERLAP_MODULE, "schedule_overlap_bucketing")


def pre_bucket_fsdp_collectives() -> Any:
    """``fsdp.pre_bucket_fsdp_collectives``: FSDP pre-bucketing alone (torch 2.13+); on a torch
    that predates it, :func:`_pre_bucket_fsdp_collectives_before_2_13`."""
    if predates_fsdp_prebucketing():
        return _pre_bucket_fsdp_collectives_before_2_13
    return _prebucketing_attr("pre_bucket_fsdp_collectives")


#: torch's pre-bucketing cap when it knows no group size, or predates the saturation model
FALLBACK_CAP_MB = 500.0


def pre_bucket_cap_mb(group_size: int | None) -> float:
    """torch's FSDP pre-bucketing cap for a group of ``group_size`` ranks (its bandwidth
    saturation model, ``fsdp.compute_pre_bucket_cap_mb``, 2.13+), else 500 MiB as torch uses
    without a group size."""
    if group_size is None or predates_fsdp_prebucketing():
        return FALLBACK_CAP_MB
    fsdp = module(FSDP_MODULE)
    compute = getattr(fsdp, "compute_pre_bucket_cap_mb", None)
    if compute is None:
        return FALLBACK_CAP_MB
    return float(compute(group_size))


def _pre_bucket_fsdp_collectives_before_2_13(
    gm: torch.fx.GraphModule, mode: str | None = None, bucket_cap_mb: float | None = None
) -> None:
    """FSDP pre-bucketing for torch 2.11/2.12, carried from torch 2.15's
    ``fsdp.pre_bucket_fsdp_collectives`` (``torch/_inductor/fx_passes/fsdp.py``): all-gathers
    whose input derives from one placeholder, reduce-scatters whose wait flows to the outputs
    through single-input ops, then all-reduces, each bucketed with that torch's own
    ``bucketing.bucket_*_by_mb`` (through ``greedy_bucket_collective_by_mb``, the site
    ``patched`` replaces) and merged with its ``merge_*``, at ``bucket_cap_mb`` or torch's
    default cap. The caller restricts it to the FSDP groups (``only_groups``). Not carried:
    2.15's bandwidth-saturation cap (it needs 2.15's ``comm_analysis``)."""
    b = module(BUCKETING_MODULE)
    is_fsdp_all_gather, _, _ = fsdp_all_gather_helpers()
    default_cap = attr(BUCKETING_MODULE, "bucket_cap_mb_by_bucket_idx_default")
    cap_fn = default_cap if bucket_cap_mb is None else (lambda _idx: bucket_cap_mb)
    resolved = mode or "default"
    gathers = b.bucket_all_gather_by_mb(
        gm, cap_fn, filter_wait_node=lambda w: is_fsdp_all_gather(w.args[0]), mode=resolved
    )
    if gathers:
        b.merge_all_gather(gm, gathers, resolved)
    scatters = b.bucket_reduce_scatter_by_mb(
        gm,
        cap_fn,
        filter_wait_node=_carried.is_fsdp_reduce_scatter_wait,
        mode=resolved.replace("_multidtype", ""),
    )
    if scatters:
        b.merge_reduce_scatter(gm, scatters, resolved)
    reduces = b.bucket_all_reduce_by_mb(
        gm, cap_fn, filter_wait_node=lambda w: bool(b.is_all_reduce_tensor(w.args[0]))
    )
    for bucket in reduces:
        b.merge_all_reduce_bucket(gm.graph, bucket)


_VIEW_PACKING: bool | None = None


def bucket_packing_needs_contiguous_inputs() -> bool:
    """Whether torch's bucketed reduce-scatter / all-reduce pack their inputs with ``view``
    (torch 2.11/2.12: ``_pre_bucket_reduce_scatter`` does ``x.view(group_size, -1)``,
    ``all_reduce_merge_fn_to_trace`` ``x.view(-1)``), which raises at run time on a
    non-contiguous input. torch 2.13+ packs with ``_chunk_cat``, which takes any strides.

    Decided by running the packing op once on a small transposed CPU tensor, not by version:
    the behaviour is what matters, and it is cached."""
    global _VIEW_PACKING
    if _VIEW_PACKING is None:
        module(BUCKETING_MODULE)  # registers torch.ops.bucketing
        pack = getattr(getattr(torch.ops, "bucketing", None), "_pre_bucket_reduce_scatter", None)
        if pack is None:
            _VIEW_PACKING = False
        else:
            probe = torch.arange(8.0).view(2, 4).t()  # (4, 2), strides (1, 4)
            try:
                pack([probe], 2)
                _VIEW_PACKING = False
            except RuntimeError:
                _VIEW_PACKING = True
    return _VIEW_PACKING
