"""``BucketingConfig``: the knobs of topo-span-bounded FSDP bucketing.

A frozen, validated dataclass. It is read from the *instance* handed to ``install``/``patched``/
``bucket_collectives`` (the reference read class attributes, so per-instance overrides were
silently ignored), and its ``fingerprint()`` feeds Inductor's cache key so a graph bucketed under
one config is never reused under another.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass

from ._source import package_source_hash


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class BucketingConfig:
    """Configuration of the bucketing patch and of ``OverlapBucketingPass``.

    Attributes:
        max_topo_span: close a bucket when adding a collective would make the distance between
            its lowest and highest topological rank exceed this; ``None`` = bytes only.
            Bounding the span stops one merge from dragging consumers of early members past
            many layers of compute (the "MM x N" backward peak-memory blow-up).
        max_compute_pre_fetch: how many compute nodes ahead of its first consumer the overlap
            scheduler may launch a collective.
        bucket_cap_mb: byte cap per bucket in MiB; ``None`` keeps torch's own cap (the
            saturation model for FSDP pre-bucketing, the caller's cap function otherwise).
        primary_group_only: treat only the process group with the most FSDP all-gathers as the
            FSDP group (minority groups, e.g. norm weights on a dp x tp group, stay unbucketed
            by the FSDP all-reduce path and do not steer the cap).
        non_adjacent: group collectives by key without requiring them to be adjacent in wait
            order (interleaved dp/tp collectives otherwise never bucket).
    """

    max_topo_span: int | None = 1500
    max_compute_pre_fetch: int = 50
    bucket_cap_mb: float | None = None
    primary_group_only: bool = True
    non_adjacent: bool = True

    def __post_init__(self) -> None:
        span = self.max_topo_span
        if span is not None and (not _is_int(span) or span < 0):
            raise ValueError(
                f"BucketingConfig.max_topo_span must be a non-negative int or None, got {span!r}"
            )
        pre = self.max_compute_pre_fetch
        if not _is_int(pre) or pre < 0:
            raise ValueError(
                f"BucketingConfig.max_compute_pre_fetch must be a non-negative int, got {pre!r}"
            )
        cap = self.bucket_cap_mb
        if cap is not None and (
            isinstance(cap, bool)
            or not isinstance(cap, (int, float))
            or not math.isfinite(cap)
            or cap <= 0
        ):
            raise ValueError(
                f"BucketingConfig.bucket_cap_mb must be a positive finite number or None, "
                f"got {cap!r}"
            )
        for name in ("primary_group_only", "non_adjacent"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"BucketingConfig.{name} must be a bool, got {value!r}")

    def fingerprint(self) -> str:
        """A short stable hash of every field plus the package's source code.

        Used for cache keys: two configs (or two versions of this package) that could bucket
        differently never share a fingerprint.
        """
        fields = ",".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        digest = hashlib.sha256(f"{fields}|{package_source_hash()}".encode())
        return digest.hexdigest()[:16]
