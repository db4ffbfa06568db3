"""Validation of ``autoparallel_backend`` options: one place that turns user input into a frozen
:class:`BackendOptions`, so a typo fails at ``autoparallel_backend(...)`` with a ValueError
naming the option instead of deep inside a compile."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import ap_epchunk
from ap_bucketing import BucketingConfig
from torch._inductor.custom_graph_pass import CustomPartitionerFn

__all__ = ["BackendOptions", "PartitionerChoice", "validate_options"]

PartitionerChoice = Literal["save_all", "min_cut"] | CustomPartitionerFn

_PARTITIONER_NAMES = ("save_all", "min_cut")


@dataclass(frozen=True)
class BackendOptions:
    enable_ac: bool
    ac_stage_size_gib: float | Literal["auto"]
    overlap_scheduling: bool
    bucketing: BucketingConfig | None
    ep_chunk: ap_epchunk.ChunkConfig | None
    partitioner: PartitionerChoice


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"autoparallel_backend: {name} must be a bool, got {value!r}")
    return value


def _check_stage_size(value: object) -> float | Literal["auto"]:
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(
            f"autoparallel_backend: ac_stage_size_gib must be 'auto' or a positive number of GiB, "
            f"got {value!r}"
        )
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"autoparallel_backend: ac_stage_size_gib must be 'auto' or a positive number of GiB, "
            f"got {value!r}"
        )
    return float(value)


def _check_bucketing(value: object) -> BucketingConfig | None:
    if value is None or value is False:
        return None
    if value is True:
        return BucketingConfig()
    if isinstance(value, BucketingConfig):
        return value
    raise ValueError(
        f"autoparallel_backend: bucketing must be None, a bool or an ap_bucketing.BucketingConfig, "
        f"got {value!r}"
    )


def _check_ep_chunk(value: object) -> ap_epchunk.ChunkConfig | None:
    if value is None or isinstance(value, ap_epchunk.ChunkConfig):
        return value
    raise ValueError(
        f"autoparallel_backend: ep_chunk must be None or an ap_epchunk.ChunkConfig, got {value!r}"
    )


def _check_partitioner(value: object) -> PartitionerChoice:
    if value is None:
        return "save_all"
    if value in _PARTITIONER_NAMES:
        return value  # type: ignore[return-value]
    if isinstance(value, CustomPartitionerFn):
        return value
    raise ValueError(
        f"autoparallel_backend: partitioner must be None, 'save_all', 'min_cut' or a "
        f"torch._inductor.custom_graph_pass.CustomPartitionerFn, got {value!r}"
    )


def validate_options(
    *,
    enable_ac: object,
    ac_stage_size_gib: object,
    overlap_scheduling: object,
    bucketing: object,
    ep_chunk: object,
    partitioner: object,
) -> BackendOptions:
    return BackendOptions(
        enable_ac=_check_bool("enable_ac", enable_ac),
        ac_stage_size_gib=_check_stage_size(ac_stage_size_gib),
        overlap_scheduling=_check_bool("overlap_scheduling", overlap_scheduling),
        bucketing=_check_bucketing(bucketing),
        ep_chunk=_check_ep_chunk(ep_chunk),
        partitioner=_check_partitioner(partitioner),
    )
