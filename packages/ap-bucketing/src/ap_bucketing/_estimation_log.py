"""torch's table of compute estimations, built only when a structured trace will write it.

Why: torch's overlap scheduler calls ``node_runtime_estimation._log_compute_estimations`` twice
per graph it schedules (gathering the estimates, then aligning them across ranks). That
function formats one row per compute node -- the node's text, every input's dtype and shape,
its FLOP count -- and only then hands the finished table to ``trace_structured``, which drops it
unless a ``TORCH_TRACE`` handler writes. Nothing else reads it. On the model kit at 8 layers
(dim 256, seq 256, fake PG 8, torch 2.15, CPU) it took 0.31 s of the full configuration's
9.6 s first backward, every compile.

:func:`estimation_log_only_when_traced` replaces it for a block with a wrapper that calls the
original only while a structured trace writes (so ``tlparse`` still shows the table) and puts
the exact original back on exit (``_scoped.ScopedReplacement``, as ``cpu_overlap_estimators``).
A torch without the function has nothing to skip: the block then changes nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any

from . import _compat
from ._scoped import ScopedReplacement

__all__ = ["estimation_log_only_when_traced"]


def _log_when_traced(*args: Any, **kwargs: Any) -> Any:
    """Stands in for torch's table builder: the original's work only when it will be written."""
    original = _TABLE.original
    if original is None or not _compat.structured_trace_writes():
        return None
    return original(*args, **kwargs)


_TABLE = ScopedReplacement(_compat.compute_estimations_log_site, _log_when_traced)


def estimation_log_only_when_traced() -> contextlib.AbstractContextManager[None]:
    """Within the block, torch's overlap scheduler builds its estimation table only while a
    structured trace writes it (see the module docstring)."""
    return _TABLE.block()
