"""Overlap scheduling's cost estimates without a GPU.

Why: torch's overlap scheduler estimates each node's runtime with GPU-only tools. On torch
2.13/2.14 ``overlap_scheduling.estimate_roofline_runtime_ms`` queries the GPU's DRAM bandwidth
and raises without one; on 2.15 it falls back by itself but logs two warnings per compute node.
:func:`cpu_runtime_estimation` is an analytical stand-in (a launch cost plus bytes moved at a
nominal bandwidth: deterministic and order-preserving, not a prediction), and
:func:`cpu_overlap_estimators` puts it in the roofline's place for a block, reversibly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.fx as fx

from . import _compat
from ._checks import require_bool, require_node
from ._scoped import ScopedReplacement
from ._sizes import hint_int

__all__ = ["cpu_overlap_estimators", "cpu_runtime_estimation", "default_cpu"]

_CPU_BYTES_PER_MS = 1e7  # ~10 GB/s: a deterministic, order-preserving stand-in on CPU


def _output_bytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else (val,)
    total = 0
    for v in vals:
        if isinstance(v, torch.Tensor):
            numel = hint_int(v.numel())
            total += (numel or 0) * v.dtype.itemsize
    return total


def cpu_runtime_estimation(node: fx.Node, override_size: int | None = None) -> float:
    """Analytical runtime (ms) for any node, usable as ``custom_runtime_estimation`` on CPU:
    a fixed launch cost plus bytes moved at a nominal bandwidth. Deterministic, needs no GPU."""
    require_node(node, where="cpu_runtime_estimation")
    size = override_size if override_size is not None else _output_bytes(node)
    return 0.005 + size / _CPU_BYTES_PER_MS


def _cpu_roofline_ms(node: fx.Node) -> float:
    return cpu_runtime_estimation(node, None)


_ROOFLINE = ScopedReplacement(_compat.roofline_estimator_site, _cpu_roofline_ms)


@contextlib.contextmanager
def cpu_overlap_estimators(enabled: bool = True) -> Iterator[None]:
    """Make overlap scheduling's estimators work without a GPU for the block (nestable).

    Replaces ``overlap_scheduling.estimate_roofline_runtime_ms`` with ``cpu_runtime_estimation``
    and restores the exact original on exit. On torch 2.13/2.14 the roofline queries the GPU's
    DRAM bandwidth and raises without one; on 2.15 it falls back by itself but logs two
    warnings per compute node ("No accelerator available for ... estimation"), thousands per
    compile, so it is replaced there too.
    """
    require_bool(enabled, where="cpu_overlap_estimators", arg="enabled")
    if not enabled:
        yield
        return
    with _ROOFLINE.block():
        yield


def default_cpu() -> bool:
    """The pass's ``cpu=None``: analytical estimators exactly when no GPU is visible."""
    return not torch.cuda.is_available()
