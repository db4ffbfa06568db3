"""Every private torch name ap-bucketing uses, looked up at call time and feature-detected.

ap-bucketing depends on torch only, so this module follows the workspace's compat convention
(``docs/architecture.md``, "Shared vocabulary and conventions") without importing ap-tags: the
tested versions are written once (``TESTED_TORCH``), a missing internal raises this package's
``UnsupportedTorchError`` naming it, and whether an internal is usable is decided by looking it
up, never by comparing version strings. The error's constructor, attributes and message are the
convention's; a cross-package test holds the two to the same message. So is the one warning
``import ap_bucketing`` logs on a torch newer than every tested version (``warn_if_untested``).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import re
import threading
from collections.abc import Iterable
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ap_bucketing import _carried

if TYPE_CHECKING:
    from torch._inductor.custom_graph_pass import CustomGraphPass as CustomGraphPass
    from torch.utils._ordered_set import OrderedSet as OrderedSet

#: The torch versions ap-bucketing is tested on (the only place they are written).
TESTED_TORCH = ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0")
PACKAGE = "ap-bucketing"

#: The two patch sites (``install``/``patched``) and the overlap scheduler.
FSDP_MODULE = "torch._inductor.fx_passes.fsdp"
BUCKETING_MODULE = "torch._inductor.fx_passes.bucketing"
OVERLAP_MODULE = "torch._inductor.fx_passes.overlap_scheduling"

T = TypeVar("T")
_ABSENT = object()


class UnsupportedTorchError(RuntimeError):
    """The installed torch lacks (or changed) an internal ap-bucketing needs.

    ``package``, ``internal`` and ``tested`` name the package, the internal and the torch
    versions it is tested on; the message says the same in one line.
    """

    def __init__(self, package: str, internal: str, tested: tuple[str, ...]) -> None:
        self.package, self.internal, self.tested = package, internal, tested
        super().__init__(
            f"{package} needs {internal}, which torch {torch.__version__} does not provide "
            f"(tested torch versions: {', '.join(tested)})"
        )


def missing(internal: str) -> UnsupportedTorchError:
    """This package's error for a missing ``internal`` (raise it)."""
    return UnsupportedTorchError(PACKAGE, internal, TESTED_TORCH)


def _series(version: str) -> tuple[int, ...]:
    found = re.match(r"(\d+)\.(\d+)", version)
    return tuple(map(int, found.groups())) if found else ()


def untested_message(package: str, tested: tuple[str, ...], version: str) -> str | None:
    """The convention's newer-torch warning: only when ``version``'s major.minor is newer than
    every tested one (a nightly of the next release, not a patch release of a tested one)."""
    current = _series(version)
    if not current or any(current <= _series(v) for v in tested):
        return None
    return (
        f"{package} is tested on torch {', '.join(tested)}; torch {version} is newer. A torch "
        f"internal {package} needs that is missing or changed raises its UnsupportedTorchError "
        "naming the internal"
    )


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


def module(name: str) -> ModuleType:
    """Import torch internal module ``name`` or raise the package's error naming it."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise missing(name) from exc


def attr(module_name: str, name: str) -> Any:
    """``module_name.name`` or the package's error naming it."""
    found = getattr(module(module_name), name, _ABSENT)
    if found is _ABSENT:
        raise missing(f"{module_name}.{name}")
    return found


def _custom_graph_pass() -> Any:
    return attr("torch._inductor.custom_graph_pass", "CustomGraphPass")


if not TYPE_CHECKING:
    # The one lookup made at import time: a class's base must exist when the class is defined
    # (``OverlapBucketingPass``). Inductor keys its FX-graph cache on ``uuid()`` only for
    # instances of this class, so the pass must derive from it.
    CustomGraphPass = _custom_graph_pass()


# --------------------------------------------------------------------------- patch sites
# (module, attribute name): what ``install``/``patched`` and ``cpu_overlap_estimators``
# replace for a while and put back exactly.


def _site(module_name: str, name: str) -> tuple[ModuleType, str]:
    attr(module_name, name)  # present, or the package's error before anything changes
    return module(module_name), name


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


# --------------------------------------------------------------------------- functions


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


@functools.cache
def foreach_copy() -> Any:
    """``torch._foreach_copy_(dsts, srcs)``: each ``srcs[i]`` copied (and cast) into
    ``dsts[i]`` in one call -- on CUDA one multi-tensor kernel where a ``copy_`` per tensor
    launches one kernel each (the coalesced form's pack of a bucket's shards)."""
    return attr("torch", "_foreach_copy_")


def c10d_ops(*names: str) -> tuple[Any, ...]:
    """The ``.default`` overloads of functional collectives (``torch.ops._c10d_functional``)."""
    found = []
    for name in names:
        try:
            found.append(getattr(torch.ops._c10d_functional, name).default)
        except (AttributeError, RuntimeError) as exc:
            raise missing(f"torch.ops._c10d_functional.{name}") from exc
    return tuple(found)


def op_overload_type() -> type:
    """``torch._ops.OpOverload``: the type of an ATen/custom op target in an FX graph."""
    op_type: type = attr("torch._ops", "OpOverload")
    return op_type


def wait_tensor_op() -> Any:
    """The functional ``wait_tensor`` overload every bucketing predicate keys on."""
    return c10d_ops("wait_tensor")[0]


def fsdp_all_gather_ops() -> tuple[Any, ...]:
    """The all-gathers torch's FSDP detection looks at (``_find_all_gathers``' order)."""
    return c10d_ops("all_gather_into_tensor", "all_gather_into_tensor_out")


def sizable_collective_ops() -> tuple[Any, ...]:
    """The collectives torch's bucketing may size (all-gathers, reduce-scatters, all-reduces)."""
    return c10d_ops(
        "all_gather_into_tensor",
        "all_gather_into_tensor_out",
        "reduce_scatter_tensor",
        "all_reduce",
    )


def ordered_set(items: Iterable[T] = ()) -> OrderedSet[T]:
    """torch's ``OrderedSet`` of ``items``: what ``identify_fsdp_groups`` returns."""
    cls: type[OrderedSet[T]] = attr("torch.utils._ordered_set", "OrderedSet")
    return cls(items)


def stable_topological_sort(graph: torch.fx.Graph) -> None:
    """Inductor's in-place topological sort that keeps already-valid orders unchanged."""
    attr("torch._inductor.pattern_matcher", "stable_topological_sort")(graph)


def reset_graph_namespace(graph: torch.fx.Graph) -> None:
    """Give ``graph`` a fresh name table (``Graph._graph_namespace``), so nodes copied back
    into an emptied graph keep their names instead of getting ``_1`` suffixes."""
    namespace: Any = getattr(graph, "_graph_namespace", _ABSENT)
    if namespace is _ABSENT:
        raise missing("torch.fx.Graph._graph_namespace")
    setattr(graph, "_graph_namespace", type(namespace)())  # noqa: B010 (a private attribute)


#: What torch's bucketing raises when a merged bucket's region cannot be reordered
#: (``graph_deduplication._stable_topological_sort_region``, torchtitan#4047).
REGION_SORT_FAILURE = "stable topological sort of region failed"


def symint_hint(value: torch.SymInt) -> int | None:
    """A concrete int for a SymInt from hints only, or ``None`` when a symbol has none.

    The node's own hint when it has one; otherwise the expression with the ShapeEnv's
    replacements, backed values (``backed_var_to_val`` from 2.15, ``var_to_val`` before) and
    ``var_to_hint_override`` entries substituted, unknown when a free symbol remains. Never
    installs a guard.
    """
    node: Any = value.node
    hint = getattr(node, "_hint", None)
    if hint is not None:
        return int(hint)
    shape_env = getattr(node, "shape_env", None)
    if shape_env is None:
        return None
    import sympy  # type: ignore[import-untyped]

    expr: Any = sympy.sympify(node.expr)
    backed = "backed_var_to_val" if hasattr(shape_env, "backed_var_to_val") else "var_to_val"
    for table in ("replacements", backed, "var_to_hint_override"):
        mapping = getattr(shape_env, table, None)
        if mapping:
            expr = expr.xreplace(mapping)
    if isinstance(expr, sympy.Expr):
        expr = expr.expand(identity=True)
    if getattr(expr, "free_symbols", None):
        return None
    try:
        return int(expr)
    except (TypeError, ValueError):
        return None
