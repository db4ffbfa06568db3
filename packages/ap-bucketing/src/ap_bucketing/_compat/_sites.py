"""The patch sites: ``(module, attribute name)`` pairs that ``install``/``patched`` and
``cpu_overlap_estimators`` replace for a while and put back exactly, and whether torch's
structured trace would write (which decides whether the estimation table is built).

Part of the compat seam (:mod:`ap_bucketing._compat`): every private torch name is looked
up at call time, through :func:`~ap_bucketing._compat._support.attr` and
:func:`~ap_bucketing._compat._support.module`."""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

from ._fsdp import _prebucketing_attr
from ._support import BUCKETING_MODULE, FSDP_MODULE, OVERLAP_MODULE, attr, module


def _site(module_name: str, name: str) -> tuple[ModuleType, str]:
    attr(module_name, name)  # present, or the package's error before anything changes
    return module(module_name), name


def fsdp_groups_site() -> tuple[ModuleType, str]:
    """``fsdp.identify_fsdp_groups``: which process groups FSDP pre-bucketing treats as FSDP."""
    _prebucketing_attr("identify_fsdp_groups")
    return module(FSDP_MODULE), "identify_fsdp_groups"


def greedy_bucketer_site() -> tuple[ModuleType, str]:
    """``bucketing.greedy_bucket_collective_by_mb``: every greedy bucketing client's bucketer."""
    return _site(BUCKETING_MODULE, "greedy_bucket_collective_by_mb")


def roofline_estimator_site() -> tuple[ModuleType, str]:
    """``overlap_scheduling.estimate_roofline_runtime_ms``: the scheduler's GPU-only estimator
    (2.12+). torch 2.11's scheduler has none; there the GPU-only estimator it calls for every
    compute node is ``estimate_runtime_analytical`` (same ``(node) -> ms`` signature), which
    asserts "Roofline estimation needs to access CUDA capabilities" without a GPU."""
    if not hasattr(module(OVERLAP_MODULE), "estimate_roofline_runtime_ms"):
        if hasattr(module(OVERLAP_MODULE), "estimate_runtime_analytical"):
            return _site(OVERLAP_MODULE, "estimate_runtime_analytical")
    return _site(OVERLAP_MODULE, "estimate_roofline_runtime_ms")


#: Where torch's overlap scheduler formats its table of compute-node estimations.
ESTIMATION_MODULE = "torch._inductor.fx_passes.node_runtime_estimation"
#: The logger whose handlers decide whether ``trace_structured`` writes anything.
TRACE_LOGGER = "torch.__trace"


def compute_estimations_log_site() -> tuple[ModuleType, str] | None:
    """``node_runtime_estimation._log_compute_estimations`` (the overlap scheduler imports it
    by name at each call), or ``None`` on a torch whose scheduler builds no such table: there
    is nothing to skip, so its absence is not an error."""
    try:
        found = importlib.import_module(ESTIMATION_MODULE)
    except ImportError:
        return None
    name = "_log_compute_estimations"
    return (found, name) if callable(getattr(found, name, None)) else None


def structured_trace_writes() -> bool:
    """Would ``torch._logging.trace_structured`` write an artifact now (``TORCH_TRACE`` on)?

    Any handler on torch's trace logger counts, except torch's own ``LazyTraceHandler`` where it
    will remove itself at its first record without writing (an open-source build, no
    ``TORCH_TRACE`` directory: the rule its ``emit`` applies). The same rule as ap-backend's
    (ap-bucketing depends on torch only, so it keeps its own copy)."""
    return any(_trace_handler_writes(h) for h in logging.getLogger(TRACE_LOGGER).handlers)


def _trace_handler_writes(handler: logging.Handler) -> bool:
    if type(handler).__name__ != "LazyTraceHandler":
        return True
    if getattr(handler, "stream", None) is not None or getattr(handler, "root_dir", None):
        return True
    import torch.version

    return not (hasattr(torch.version, "git_version") and os.getenv("MAST_HPC_JOB_NAME") is None)
