"""Validation of ``autoparallel_backend`` options: one place that turns user input into a frozen
:class:`BackendOptions`, so a typo fails at ``autoparallel_backend(...)`` naming the option
instead of deep inside a compile.

The checks follow ``ap_tags.checks``: a value of the wrong type raises ``TypeError``, a value
of the right type that is not allowed (an unknown partitioner name, a non-positive stage size)
raises ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeAlias

import ap_epchunk
import ap_partitioner
import ap_tags
import torch.fx
from ap_bucketing import BucketingConfig
from ap_tags.checks import describe, require_bool, require_instance

from ap_backend import _compat

__all__ = [
    "PREFETCH",
    "BackendOptions",
    "OverlapChoice",
    "Partitioner",
    "PartitionerChoice",
    "validate_options",
]


class Partitioner(Protocol):
    """What Inductor calls as ``custom_partitioner_fn`` (a ``CustomPartitionerFn``)."""

    def __call__(
        self, gm: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]: ...

    def uuid(self) -> Any: ...


PartitionerChoice: TypeAlias = Literal["save_all", "min_cut"] | Partitioner

_PARTITIONER_NAMES = ("save_all", "min_cut")

#: ``overlap_scheduling="prefetch"``: ap-bucketing's FSDP prefetch schedule instead of torch's
#: cost-model scheduler (``ap_bucketing.OverlapBucketingPass(reorder="prefetch")``)
PREFETCH = "prefetch"
OverlapChoice: TypeAlias = bool | Literal["prefetch"]


@dataclass(frozen=True)
class BackendOptions:
    enable_ac: bool
    ac_stage_size_gib: float | Literal["auto"]
    overlap_scheduling: OverlapChoice
    bucketing: BucketingConfig | None
    ep_chunk: ap_epchunk.ChunkConfig | None
    partitioner: PartitionerChoice
    activation_budget_bytes: int | None = None


#: ``autoparallel_backend``'s default for ``bucketing``: on, except with ``ep_chunk`` and without
#: ``overlap_scheduling``. Why the exception: bucketing after the chunk schedule without the
#: overlap scheduler (which re-sorts the bucketed graph) once failed on torchtitan's Qwen3-MoE
#: with real EP (``BackendCompilerFailed``: a wait used before it was defined). It trains like
#: eager there now (``tests/test_zoo.py``, asked for with ``bucketing=True``), but the EP route
#: matrix is measured without bucketing (``default``) or with both (``full``), so the default
#: stays off until that matrix is measured with it.
AUTO_BUCKETING = "auto"


def auto_bucketing(ep_chunk: object, overlap_scheduling: object) -> bool:
    """What ``bucketing="auto"`` (the default) means for these options (see
    :data:`AUTO_BUCKETING`)."""
    return ep_chunk is None or overlap_scheduling is True or overlap_scheduling == PREFETCH


#: the copy-free bucket form (``ap_bucketing``'s ``bucket_mode="coalesced"``)
COPY_FREE = "coalesced"


def copy_free_by_default(
    bucketing: object,
    resolved: BucketingConfig | None,
    overlap: OverlapChoice,
    ep_chunk: ap_epchunk.ChunkConfig | None,
) -> bool:
    """Whether ap's bucketing (``bucketing="auto"`` or ``True``, no ``BucketingConfig`` of the
    caller's) takes the copy-free form, ``bucket_mode="coalesced"``, in place of
    ``BucketingConfig()``'s ``"custom_ops"``: wherever torch's overlap scheduler does not run
    (no overlap scheduling, or ap's ``"prefetch"`` schedule, which moves whole buckets).

    Why: a ``"custom_ops"`` bucket moves through one flat buffer -- its gathered bytes are copied
    out to the members and its gradients copied in before the reduce-scatter (about 1.8 ms of
    the H200 kit's 47 ms step; on torch 2.11, the GPU machine's, Inductor emits those copies as
    kernels of their own: 411 kernels against plain ``torch.compile``'s 369 on the CPU kit at
    dim 1024, 299 copy-free) -- and holds the flat buffer beside its members while it copies
    out (two blocks' gathered bytes above ``bucketing=False`` at the peak, one copy-free).
    Not taken where it is not known to hold: under torch's overlap scheduler
    (``overlap_scheduling=True``), which cannot take a coalesced bucket (torch 2.11's takes one
    wait per collective; torch 2.15.0's fails when it forces an earlier bucket's wait before
    that wait's ``getitem`` is scheduled), so a flat bucket,
    and with ``ep_chunk`` (bucketing after the chunk schedule without a scheduler has been
    measured in neither form; ``"prefetch"`` refuses it)."""
    return (
        resolved is not None
        and not isinstance(bucketing, BucketingConfig)
        and overlap is not True
        and ep_chunk is None
    )


def _check_bucketing(value: object, where: str) -> BucketingConfig | None:
    if value is None or value is False:
        return None
    if value is True:
        return BucketingConfig()
    return require_instance(
        value,
        BucketingConfig,
        where=where,
        arg="bucketing",
        expected="'auto', None, a bool or an ap_bucketing.BucketingConfig",
    )


def _check_overlap(value: object, where: str) -> OverlapChoice:
    if value == PREFETCH:
        return "prefetch"
    if isinstance(value, str):
        raise ValueError(
            f"{where}: overlap_scheduling must be a bool or {PREFETCH!r}, got {value!r}"
        )
    return require_bool(value, where=where, arg="overlap_scheduling")


def _check_prefetch(
    bucketing: object, resolved: BucketingConfig | None, ep_chunk: object, where: str
) -> None:
    """What ``overlap_scheduling="prefetch"`` refuses: no bucketing (the schedule orders
    buckets), and ``ep_chunk`` (the chunk schedule's order has been measured under torch's
    scheduler only). Its bucketing is the copy-free form unless the caller passed a
    ``BucketingConfig`` (:func:`copy_free_by_default`)."""
    if ep_chunk is not None:
        raise ValueError(
            f"{where}: overlap_scheduling={PREFETCH!r} with ep_chunk: the chunk schedule has "
            "been measured under torch's overlap scheduler (overlap_scheduling=True) only"
        )
    if resolved is None:
        raise ValueError(
            f"{where}: overlap_scheduling={PREFETCH!r} orders FSDP buckets and needs bucketing; "
            f"got bucketing={bucketing!r}"
        )


def _check_ep_chunk(value: object, where: str) -> ap_epchunk.ChunkConfig | None:
    if value is None:
        return None
    return require_instance(
        value,
        ap_epchunk.ChunkConfig,
        where=where,
        arg="ep_chunk",
        expected="None or an ap_epchunk.ChunkConfig",
    )


def _check_partitioner(value: object, where: str) -> PartitionerChoice:
    names = " or ".join(repr(n) for n in _PARTITIONER_NAMES)
    if value is None:
        return "save_all"
    if isinstance(value, str):
        if value not in _PARTITIONER_NAMES:
            raise ValueError(f"{where}: partitioner must be {names}, got {value!r}")
        return value  # type: ignore[return-value]
    if not _compat.is_custom_partitioner(value):
        raise TypeError(
            f"{where}: partitioner must be None, {names} or a CustomPartitionerFn, "
            f"got {describe(value)}"
        )
    partitioner: Partitioner = value  # type: ignore[assignment]
    return partitioner


def validate_options(
    *,
    where: str = "autoparallel_backend",
    enable_ac: object = False,
    ac_stage_size_gib: object = "auto",
    overlap_scheduling: object = False,
    bucketing: object = None,
    ep_chunk: object = None,
    partitioner: object = None,
    activation_budget_bytes: object = None,
) -> BackendOptions:
    """The options as a :class:`BackendOptions` (defaults: ``autoparallel_backend``'s);
    ``where`` names the caller in messages."""
    choice = _check_partitioner(partitioner, where)
    budget = (
        None
        if activation_budget_bytes is None
        else ap_partitioner.check_activation_budget(activation_budget_bytes, where=where)
    )
    if budget is not None and choice != "save_all":
        raise ValueError(
            f"{where}: activation_budget_bytes applies to the save-all replay "
            f"(partitioner=None or 'save_all'), not to partitioner={partitioner!r}; for a "
            "partitioner instance, pass ap_partitioner.SaveAllPartitioner("
            "activation_budget_bytes=...)"
        )
    overlap = _check_overlap(overlap_scheduling, where)
    chunk = _check_ep_chunk(ep_chunk, where)
    resolved = _check_bucketing(
        auto_bucketing(chunk, overlap) if bucketing == AUTO_BUCKETING else bucketing, where
    )
    if overlap == PREFETCH:
        _check_prefetch(bucketing, resolved, chunk, where)
    if copy_free_by_default(bucketing, resolved, overlap, chunk):
        resolved = BucketingConfig(bucket_mode=COPY_FREE)
    return BackendOptions(
        enable_ac=require_bool(enable_ac, where=where, arg="enable_ac"),
        ac_stage_size_gib=ap_tags.check_stage_size(
            ac_stage_size_gib, where=where, arg="ac_stage_size_gib"
        ),
        overlap_scheduling=overlap,
        bucketing=resolved,
        ep_chunk=chunk,
        partitioner=choice,
        activation_budget_bytes=budget,
    )
