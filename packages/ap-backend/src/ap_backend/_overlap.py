"""Inductor overlap-scheduling settings for ``compile_fx(config_patches=...)``.

The settings travel through ``config_patches`` because compile_fx re-applies those patches
around ``inner_compile``, which is what reaches the backward that AOTAutograd compiles lazily on
the first ``.backward()`` -- long after the backend call (and any ``with`` block in it) has
returned.

* With ap-bucketing: ap-bucketing's own patches (its ``OverlapBucketingPass`` as the post-grad
  post pass: FSDP pre-bucketing under the topo-span rules, then torch's scheduler when
  ``overlap_scheduling=True``, ap's FSDP prefetch schedule when ``"prefetch"``), which
  already carry the CPU estimator recipe.
* Without: torch's built-in overlap scheduler. On a machine without a GPU its default
  estimators ask triton/CUDA for bandwidth and timings and fail, so the CPU recipe applies:
  analytical compute estimator, ap-bucketing's CPU runtime estimation, no fusion regions, and
  (torch 2.13/2.14) ap-bucketing's scoped roofline-estimator replacement, entered per inner
  compile by the backend.
"""

from __future__ import annotations

from typing import Any

import ap_bucketing
import torch

from ap_backend import _compat

__all__ = ["has_gpu", "overlap_config_patches"]

_PREFIX = "aten_distributed_optimizations."


def has_gpu() -> bool:
    """A CUDA device is usable (else overlap scheduling needs the CPU estimator recipe)."""
    return bool(torch.cuda.is_available())


def overlap_config_patches(
    *,
    overlap_scheduling: bool | str,
    bucketing: ap_bucketing.BucketingConfig | None,
    max_compute_pre_fetch: int = 10,
) -> dict[str, Any]:
    """The ``compile_fx(config_patches=...)`` dict for these options (empty when neither).
    ``overlap_scheduling="prefetch"`` (with bucketing: the options refuse it without) is
    ap-bucketing's FSDP prefetch schedule in place of torch's scheduler."""
    if bucketing is not None:
        return dict(ap_bucketing.overlap_config_patches(bucketing, reorder=overlap_scheduling))
    if overlap_scheduling is not True:
        return {}
    patches: dict[str, Any] = {
        _PREFIX + "enable_overlap_scheduling": True,
        _PREFIX + "collective_bucketing": True,
        _PREFIX + "insert_overlap_deps": True,
        _PREFIX + "max_compute_pre_fetch": max_compute_pre_fetch,
    }
    if not has_gpu():
        patches.update(
            {
                _PREFIX + "enable_fusion_regions": False,
                _PREFIX + "compute_estimator": "analytical",
                _PREFIX + "collective_estimator": "analytical",
                _PREFIX + "custom_runtime_estimation": ap_bucketing.cpu_runtime_estimation,
            }
        )
        if not _compat.inductor_has_option(_PREFIX + "compute_estimator"):
            # torch 2.11: no choice to make; its scheduler's analytical estimator is the one
            # ap_bucketing.cpu_overlap_estimators replaces for the inner compile
            del patches[_PREFIX + "compute_estimator"]
    return patches
