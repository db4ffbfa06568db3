"""Inductor overlap-scheduling settings, including the recipe that makes them run on CPU.

The settings travel through ``compile_fx(config_patches=...)``: compile_fx re-applies those
patches around ``inner_compile``, which is what reaches the backward that AOTAutograd compiles
lazily on the first ``.backward()`` -- long after the backend call (and any ``with`` block in
it) has returned.

On a machine without a GPU the stock settings fail: the roofline/benchmark estimators ask
triton or CUDA for bandwidth and timing. The CPU recipe uses the analytical collective
estimator, a constant compute estimate, and no fusion regions; torch 2.13/2.14 additionally
call ``overlap_scheduling.estimate_roofline_runtime_ms`` unconditionally, which is replaced for
the duration of one inner compile only (on 2.15 it only silences a warning per node) (see :func:`cpu_roofline_patch`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx

__all__ = ["cpu_roofline_patch", "overlap_config_patches"]

#: Compute-node runtime (ms) used when no accelerator can be asked. Any positive constant works:
#: on CPU the schedule only has to be valid, not fast.
_CPU_COMPUTE_MS = 0.01


def _cpu_runtime_estimate(node: torch.fx.Node, override_size: int | None = None) -> float | None:
    """Constant compute estimate; ``None`` for collectives so the analytical model is used.
    Module-level (not a lambda) so Inductor can pickle it into its cache key."""
    if getattr(node.target, "namespace", None) == "_c10d_functional":
        return None
    return _CPU_COMPUTE_MS


def _has_gpu() -> bool:
    return bool(torch.cuda.is_available())


def overlap_config_patches(*, bucketing: bool, max_compute_pre_fetch: int = 10) -> dict[str, Any]:
    """The ``compile_fx(config_patches=...)`` dict turning on Inductor's overlap scheduler
    (with collective bucketing when ``bucketing``), plus the CPU recipe when no GPU exists."""
    prefix = "aten_distributed_optimizations."
    patches: dict[str, Any] = {
        prefix + "enable_overlap_scheduling": True,
        prefix + "collective_bucketing": bucketing,
        prefix + "insert_overlap_deps": True,
        prefix + "max_compute_pre_fetch": max_compute_pre_fetch,
    }
    if not _has_gpu():
        patches.update(
            {
                prefix + "enable_fusion_regions": False,
                prefix + "compute_estimator": "analytical",
                prefix + "collective_estimator": "analytical",
                prefix + "custom_runtime_estimation": _cpu_runtime_estimate,
            }
        )
    return patches


def _needs_roofline_patch() -> bool:
    """torch < 2.15 estimates every compute node's roofline before consulting the custom
    estimator, and that needs triton/CUDA; 2.15 degrades to one warning per node, which is
    noise -- so the patch applies on every CPU-only machine."""
    return not _has_gpu()


def _constant_roofline(node: torch.fx.Node) -> float:
    return _CPU_COMPUTE_MS


@contextlib.contextmanager
def cpu_roofline_patch() -> Iterator[None]:
    """Replace ``overlap_scheduling.estimate_roofline_runtime_ms`` for one inner compile on
    CPU-only torch < 2.15; restores the original exactly on exit. A no-op elsewhere."""
    if not _needs_roofline_patch():
        yield
        return
    from torch._inductor.fx_passes import overlap_scheduling as sched

    original = getattr(sched, "estimate_roofline_runtime_ms", None)
    if original is None:
        yield
        return
    sched.estimate_roofline_runtime_ms = _constant_roofline
    try:
        yield
    finally:
        sched.estimate_roofline_runtime_ms = original
