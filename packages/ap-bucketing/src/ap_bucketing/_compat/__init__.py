"""Every private torch name ap-bucketing uses, looked up at call time and feature-detected.

ap-bucketing depends on torch only, so this package follows the workspace's compat convention
(``docs/architecture.md``, "Shared vocabulary and conventions") without importing ap-tags: the
tested versions are written once (``TESTED_TORCH``), a missing internal raises this package's
``UnsupportedTorchError`` naming it, and whether an internal is usable is decided by looking it
up, never by comparing version strings. The error's constructor, attributes and message are the
convention's; a cross-package test holds the two to the same message. So is the one warning
``import ap_bucketing`` logs on a torch newer than every tested version (``warn_if_untested``).

The seam is this package, one module per concern (``_support``: the lookups and the error;
``_fsdp``: torch's FSDP pre-bucketing, bucketing and overlap-scheduling functions; ``_sites``: the patch sites;
``_graph``: ops and graph helpers). Callers use the names re-exported here.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import torch

from ._fsdp import (
    FALLBACK_CAP_MB,
    FSDP_PREBUCKETING_SINCE,
    all_reduce_bucketing,
    bucket_packing_needs_contiguous_inputs,
    fsdp_all_gather_helpers,
    fsdp_reduce_scatter_wait_predicate,
    is_compute_node_predicate,
    pre_bucket_cap_mb,
    pre_bucket_fsdp_collectives,
    predates_fsdp_prebucketing,
    require_default_mode_reordering,
    schedule_overlap_bucketing,
)
from ._graph import (
    REGION_SORT_FAILURE,
    c10d_ops,
    foreach_copy,
    fsdp_all_gather_ops,
    op_overload_type,
    ordered_set,
    reset_graph_namespace,
    sizable_collective_ops,
    stable_topological_sort,
    symint_hint,
    wait_tensor_op,
)
from ._sites import (
    ESTIMATION_MODULE,
    TRACE_LOGGER,
    compute_estimations_log_site,
    fsdp_groups_site,
    greedy_bucketer_site,
    roofline_estimator_site,
    structured_trace_writes,
)
from ._support import (
    BUCKETING_MODULE,
    FSDP_MODULE,
    OVERLAP_MODULE,
    PACKAGE,
    TESTED_TORCH,
    CustomGraphPass,
    UnsupportedTorchError,
    attr,
    missing,
    module,
    untested_message,
)

if TYPE_CHECKING:
    from ._support import OrderedSet as OrderedSet

_WARNED: set[str] = set()
_WARNED_LOCK = threading.Lock()


def warn_if_untested() -> bool:
    """Log :func:`untested_message` once per process on the ``ap_bucketing`` logger; True when
    it logged now. A version compare decides this warning only, never a feature."""
    message = untested_message(PACKAGE, TESTED_TORCH, str(torch.__version__))
    with _WARNED_LOCK:
        if message is None or PACKAGE in _WARNED:
            return False
        _WARNED.add(PACKAGE)
    logging.getLogger("ap_bucketing").warning(message)
    return True


__all__ = [
    "BUCKETING_MODULE",
    "CustomGraphPass",
    "ESTIMATION_MODULE",
    "FALLBACK_CAP_MB",
    "FSDP_MODULE",
    "FSDP_PREBUCKETING_SINCE",
    "OVERLAP_MODULE",
    "PACKAGE",
    "REGION_SORT_FAILURE",
    "TESTED_TORCH",
    "TRACE_LOGGER",
    "UnsupportedTorchError",
    "all_reduce_bucketing",
    "attr",
    "bucket_packing_needs_contiguous_inputs",
    "c10d_ops",
    "compute_estimations_log_site",
    "foreach_copy",
    "fsdp_all_gather_helpers",
    "fsdp_all_gather_ops",
    "fsdp_groups_site",
    "fsdp_reduce_scatter_wait_predicate",
    "greedy_bucketer_site",
    "is_compute_node_predicate",
    "missing",
    "module",
    "op_overload_type",
    "ordered_set",
    "pre_bucket_cap_mb",
    "pre_bucket_fsdp_collectives",
    "predates_fsdp_prebucketing",
    "require_default_mode_reordering",
    "reset_graph_namespace",
    "roofline_estimator_site",
    "schedule_overlap_bucketing",
    "sizable_collective_ops",
    "stable_topological_sort",
    "structured_trace_writes",
    "symint_hint",
    "untested_message",
    "wait_tensor_op",
    "warn_if_untested",
]
