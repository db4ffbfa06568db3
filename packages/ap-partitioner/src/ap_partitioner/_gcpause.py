"""``paused_gc()``: no cyclic garbage collection while a partition is built.

Why: partitioning allocates hundreds of thousands of short-lived, acyclic objects (nodes, arg
tuples, meta dicts, generated code). Each allocation burst triggers generation-2 sweeps that
walk the whole heap, which at that point holds several copies of a graph with thousands of
nodes, so the collector's cost grows with (allocations x heap): at 32 layers it was 70% of the
partition's wall time and made the partitioner quadratic. Nothing allocated here needs the
cyclic collector to be freed promptly; what is garbage is collected at the next sweep after the
block.

Scoping: the first entry remembers whether the collector was enabled and disables it; the last
exit re-enables it only if it was enabled. A lock and a depth counter make it nestable and safe
from several threads; the state is restored even when the body raises.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def paused_gc() -> Iterator[None]:
    """Disable the cyclic garbage collector inside the block (see module doc)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
