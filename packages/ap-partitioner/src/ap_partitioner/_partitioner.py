"""``SaveAllPartitioner``: replay the first compilation's saves instead of solving min-cut.

Why: the joint graph is partitioned twice (first compilation, then the user's
``torch.compile``). The second sees a different graph; with an AC pass on, min-cut recomputes
matmuls in the backward, which needs the unsharded weights, and ``force_save_collectives`` then
pins those all-gather outputs as saved. The first compilation already stamped what it saved
(``custom["ap_must_save"]``, carried through the retrace), so this partitioner saves exactly
that: torch's prologue, the rules in :mod:`ap_partitioner._rules`, torch's extraction and
epilogue. A replay that does not cut the new graph falls back to min-cut (or raises when
``strict``), never crashing training silently.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ap_tags
import torch.fx as fx
from ap_tags.checks import require_bool, require_callable, require_graph_module, require_int
from ap_tags.graph import backward_nodes, is_all_gather
from ap_tags.scoped import paused_gc

from ap_partitioner import _compat
from ap_partitioner._budget import (
    budget_fields,
    budget_notes,
    check_activation_budget,
    fit_to_budget,
)
from ap_partitioner._call_args import PartitionCall, check_call
from ap_partitioner._compat import CustomPartitionerFn
from ap_partitioner._cut import blocked_by_recompute_tag, missing_values
from ap_partitioner._dce import wait_tensor_dce
from ap_partitioner._epilogue import run_epilogue
from ap_partitioner._fallback_tags import release_unsatisfiable_recompute, sanitize_tags
from ap_partitioner._narrow import narrow_widening_casts, narrowed_fields, narrowed_note
from ap_partitioner._prologue import (
    Prologue,
    run_prologue,
    save_effectful_instead_of_recompute,
)
from ap_partitioner._regathers import merge_recomputed_gathers
from ap_partitioner._report import (
    PartitionReport,
    ReportCallback,
    build_report,
    emit,
)
from ap_partitioner._rules import SavePlan, plan_saves, without_views_of_saved
from ap_partitioner._working_copy import working_copy

log = logging.getLogger(__name__)

Partition = tuple[fx.GraphModule, fx.GraphModule]


class ReplayError(RuntimeError):
    """``strict=True`` and the replayed save set is not a valid cut of the joint graph."""

    def __init__(self, reason: str, missing: Sequence[str] = ()) -> None:
        super().__init__(reason)
        self.reason = reason
        self.missing = tuple(missing)


def source_files() -> list[Path]:
    """Every Python file of this package, subpackages included, found by globbing its directory
    (so a module that is added, renamed or removed changes the hash without anyone updating a
    list; a subpackage, such as a compat seam split into one, counts as ap-bucketing's does)."""
    return sorted(Path(__file__).parent.rglob("*.py"))


def _files_hash(root: Path, paths: Sequence[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def source_hash() -> str:
    """sha256 over this package's own source files: any code change changes every uuid."""
    return _files_hash(Path(__file__).parent, source_files())


@functools.cache
def ap_tags_source_hash() -> str:
    """sha256 over ap-tags' source files: the save rules call its accessors, tag keys and graph
    vocabulary, so its code decides the partition as much as this package's does."""
    root = Path(ap_tags.__file__).parent
    return _files_hash(root, sorted(root.rglob("*.py")))


def dependencies_key() -> str:
    """The other packages whose code decides the partition, by version and source hash (an
    ap-tags edited in place keeps its version): ``ap-tags==0.1.0:<sha256>``."""
    return f"ap-tags=={ap_tags.__version__}:{ap_tags_source_hash()}"


def _min_cut(joint: fx.GraphModule, call: PartitionCall) -> Partition:
    """torch's ``min_cut_rematerialization_partition`` of ``joint``, as Inductor calls it."""
    fw, bw = _compat.partitioners().min_cut_rematerialization_partition(
        joint,
        call.joint_inputs,
        call.compiler,
        num_fwd_outputs=call.num_fwd_outputs,
        static_lifetime_input_indices=call.static,
    )
    return fw, bw


Outcome = tuple[fx.GraphModule, fx.GraphModule, dict[str, Any]]


class _ReportingPartitioner(CustomPartitionerFn):
    """One partitioner call: validated (before anything runs), timed, measured into a
    :class:`PartitionReport` and emitted; subclasses say how to partition (``_run``)."""

    name: str
    on_report: ReportCallback | None

    def __call__(
        self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> Partition:
        call = check_call(type(self).__name__, gm, joint_inputs, kwargs)
        _compat.partitioners()  # an unsupported torch fails before anything runs
        start = time.perf_counter()
        fw, bw, extra = self._run(call)
        report = build_report(
            extra.pop("partitioner", self.name),
            fw,
            bw,
            call.num_fwd_outputs,
            partition_time_s=time.perf_counter() - start,
            **extra,
        )
        emit(report, self.on_report)
        return fw, bw

    def _run(self, call: PartitionCall) -> Outcome:
        """``(fw, bw, report fields)``; ``"partitioner"`` in the fields overrides ``name``."""
        raise NotImplementedError


class SaveAllPartitioner(_ReportingPartitioner):
    """Save exactly the tagged values (see :mod:`ap_partitioner._rules`); set it as
    ``torch._inductor.config.custom_partitioner_fn`` or pass it as an AOT ``partition_fn``.

    Options: ``strict`` raises :class:`ReplayError` instead of falling back to min-cut on an
    invalid replay (and lets ``ap_tags.TagError`` through on malformed tags, which otherwise
    also fall back; tags of another tag-schema version always raise ``ap_tags.TagSchemaError``); ``on_report`` receives a :class:`PartitionReport` per call;
    ``dce_unused_waits`` wraps the partition in :func:`wait_tensor_dce` so an unused wait (and
    the cast parameter feeding its all-gather) is not handed to the backward.
    ``activation_budget_bytes``: keep the saved activations of each partition at or under this
    many bytes by recomputing the cheapest replayed saves in the backward
    (:mod:`ap_partitioner._budget`); a budget under the graph's floor raises
    :class:`BudgetError` naming the floor (never a fallback).
    """

    name = "save_all"

    def __init__(
        self,
        strict: bool = False,
        on_report: ReportCallback | None = None,
        *,
        dce_unused_waits: bool = True,
        activation_budget_bytes: int | None = None,
    ) -> None:
        owner = type(self).__name__
        self.strict = require_bool(strict, where=owner, arg="strict")
        self.on_report = require_callable(on_report, where=owner, arg="on_report", optional=True)
        self.dce_unused_waits = require_bool(dce_unused_waits, where=owner, arg="dce_unused_waits")
        self.activation_budget_bytes = (
            None
            if activation_budget_bytes is None
            else check_activation_budget(activation_budget_bytes, where=owner)
        )

    def uuid(self) -> str:
        """Changes with this package's code, with ap-tags' version and code (the rules read the
        tags through it: :func:`dependencies_key`) and with every option that changes the output.

        A ``None`` uuid would not bypass Inductor's caches: with a warm cache the partitioner
        would be silently skipped. ``on_report`` is an observer and is not part of the key.
        """
        opts = (
            f"strict={self.strict};dce_unused_waits={self.dce_unused_waits};"
            f"activation_budget_bytes={self.activation_budget_bytes}"
        )
        key = f"{self.name};{source_hash()};{dependencies_key()};{opts}"
        return hashlib.sha256(key.encode()).hexdigest()

    def _run(self, call: PartitionCall) -> Outcome:
        scope = wait_tensor_dce() if self.dce_unused_waits else contextlib.nullcontext()
        with paused_gc(), scope:
            return self._replay(call)

    def _replay(self, call: PartitionCall) -> Outcome:
        mod = _compat.partitioners()
        gm, num_fwd_outputs = call.gm, call.num_fwd_outputs
        try:
            ap_tags.validate_tags(gm.graph, retraced=True)
        except ap_tags.TagError as exc:
            if self.strict or isinstance(exc, ap_tags.TagSchemaError):
                raise  # a schema mismatch is a setup error: never guess what old keys meant
            clean = working_copy(gm)
            sanitize_tags(clean, exc.problems)
            return self._fallback(clean, call, f"malformed tags: {exc}", [], ())
        # the replay works on a copy: a refusal leaves the caller's graph exactly as it was
        pro = run_prologue(gm)
        notes = tuple(
            f"effectful op saved instead of recomputed: {n}" for n in pro.effectful_retagged
        )
        info = mod.classify_nodes(pro.module, call.static, num_fwd_outputs)
        if len(info.required_bw_nodes) == 0:
            fw, bw = mod.default_partition(
                pro.module,
                call.joint_inputs,
                num_fwd_outputs=num_fwd_outputs,
                static_lifetime_input_indices=call.static,
                static_lifetime_input_nodes=info.static_lifetime_input_nodes,
            )
            note = "no backward nodes: delegated to default_partition"
            return fw, bw, {"partitioner": "default", "notes": (*notes, note)}
        replayed = ap_tags.replayed_saves(pro.module.graph)
        notes = (*notes, *replayed.notes())
        plan, narrowed = narrow_widening_casts(
            plan_saves([*info.required_fw_nodes, *info.unclaimed_nodes], replayed=replayed.values)
        )
        if narrowed:
            notes = (*notes, narrowed_note(narrowed))
        plan, views = without_views_of_saved(plan)
        if views:
            notes = (
                *notes,
                f"views of saved values recomputed from their base: {', '.join(views)}",
            )
        budget: dict[str, object] = {}
        if self.activation_budget_bytes is not None:
            fitted = fit_to_budget(pro.module.graph, plan, self.activation_budget_bytes)
            plan = fitted.plan
            budget = budget_fields(fitted)
            notes = (*notes, *budget_notes(fitted))
        missing = missing_values(pro.module, plan, num_fwd_outputs)
        if missing:
            reason = self._missing_reason(pro.module, missing)
            return self._fallback(working_copy(gm), call, reason, missing, notes)
        try:
            fw, bw, merged = self._extract(pro, plan, info, num_fwd_outputs)
        except Exception as exc:  # torch's extraction refuses the cut: same policy as missing
            reason = f"extraction of the replayed cut failed: {type(exc).__name__}: {exc}"
            return self._fallback(working_copy(gm), call, reason, [], notes, cause=exc)
        if merged:
            notes = (
                *notes,
                f"{len(merged)} repeated all-gather(s) of the backward merged into the earlier "
                f"gather of the same weight: {', '.join(merged)}",
            )
        dropped = {
            "dropped_first_saves": replayed.dropped,
            "dropped_first_saves_why": replayed.dropped_why,
        }
        return fw, bw, {"notes": notes, **dropped, **narrowed_fields(narrowed), **budget}

    @staticmethod
    def _missing_reason(joint: fx.GraphModule, missing: list[str]) -> str:
        blocked = blocked_by_recompute_tag(joint, missing)
        reason = (
            "replayed save set is not a valid cut: the backward needs values that are neither "
            f"saved nor recomputable: {', '.join(missing)}"
        )
        if blocked:
            reason += f" (MUST_RECOMPUTE refused saving: {', '.join(blocked)})"
        return reason

    @staticmethod
    def _extract(
        pro: Prologue, plan: SavePlan, info: Any, num_fwd_outputs: int
    ) -> tuple[fx.GraphModule, fx.GraphModule, list[str]]:
        """The partition of ``plan``, and the backward all-gathers merged into an earlier one
        (a recomputation's re-gather of a weight the backward gathers anyway:
        :mod:`ap_partitioner._regathers`), on the backward's final order."""
        sym_nodes = list(plan.sym_nodes)  # torch mutates it to the symbols actually saved
        fw, bw = _compat.extract_fwd_bwd_modules(
            pro.module,
            plan.values,
            sym_nodes,
            plan.opaque_nodes,
            num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_nodes=info.static_lifetime_input_nodes,
        )
        fw, bw = run_epilogue(pro, fw, bw, len(sym_nodes))
        joint = pro.module.graph
        merged = merge_recomputed_gathers(
            bw.graph, lambda: {n.name for n in backward_nodes(joint) if is_all_gather(n)}
        )
        if merged:
            bw.recompile()  # lazy where the extraction's module is: code generated when needed
        return fw, bw, merged

    def _fallback(
        self,
        joint: fx.GraphModule,
        call: PartitionCall,
        reason: str,
        missing: Sequence[str],
        notes: tuple[str, ...],
        cause: BaseException | None = None,
    ) -> Outcome:
        """Partition the working copy ``joint`` with min-cut instead (or raise when strict)."""
        if self.strict:
            raise ReplayError(f"SaveAllPartitioner(strict=True): {reason}", missing) from cause
        log.warning("ap-partitioner: %s; falling back to min-cut", reason)
        save_effectful_instead_of_recompute(joint.graph)  # min-cut on 2.15 would raise
        released = release_unsatisfiable_recompute(joint, missing)
        if released:
            notes = (
                *notes,
                f"MUST_RECOMPUTE dropped for the min-cut fallback: {', '.join(released)}",
            )
        fw, bw = _min_cut(joint, call)
        extra = {
            "fell_back": True,
            "fallback_reason": reason,
            "missing_values": tuple(missing),
            "notes": notes,
        }
        return fw, bw, extra


class MinCutPartitioner(_ReportingPartitioner):
    """torch's ``min_cut_rematerialization_partition``, unchanged, plus the same
    :class:`PartitionReport` so min-cut and save-all can be compared field by field."""

    name = "min_cut"

    def __init__(self, on_report: ReportCallback | None = None) -> None:
        self.on_report = require_callable(
            on_report, where=type(self).__name__, arg="on_report", optional=True
        )

    def uuid(self) -> str:
        return hashlib.sha256(f"{self.name};{source_hash()}".encode()).hexdigest()

    def _run(self, call: PartitionCall) -> Outcome:
        fw, bw = _min_cut(call.gm, call)
        return fw, bw, {}


def report_for(
    fw_module: fx.GraphModule,
    bw_module: fx.GraphModule,
    num_fwd_outputs: int,
    *,
    partitioner: str = "external",
    partition_time_s: float = 0.0,
) -> PartitionReport:
    """Measure a partition produced elsewhere (e.g. torch's ``default_partition`` in the first
    compilation) with the same fields as the partitioners' own reports."""
    require_graph_module(fw_module, where="report_for", arg="fw_module")
    require_graph_module(bw_module, where="report_for", arg="bw_module")
    require_int(num_fwd_outputs, where="report_for", arg="num_fwd_outputs", minimum=0)
    return build_report(
        partitioner, fw_module, bw_module, num_fwd_outputs, partition_time_s=partition_time_s
    )
