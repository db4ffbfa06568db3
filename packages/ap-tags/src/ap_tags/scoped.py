"""Process-wide changes that are scoped, nestable, thread-safe and exception-safe.

Several ap passes must change something process-wide for the duration of a call: torch's
side-effect registry (so DCE may drop unused waits), ``torch.autograd.grad`` (so traced
backward nodes get provenance), a torch logger's level, the cyclic garbage collector. Each
change is a :class:`ScopedPatch`: the first ``with`` entry applies it, the last exit undoes it,
a lock and a depth counter make concurrent and nested use safe, and an ``apply`` that raises
leaves nothing applied. Nothing here is applied at import time.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
from collections.abc import Callable, Iterator

__all__ = ["ScopedPatch", "paused_gc", "quiet_logger"]

Undo = Callable[[], None]


class ScopedPatch:
    """A reversible process-wide change shared by every concurrent user.

    ``apply()`` makes the change and returns the function that undoes it exactly. It runs on
    the first entry only (depth 0 -> 1); the undo runs on the last exit (1 -> 0), even when
    the body raised. If ``apply`` raises, the depth stays 0 and the error propagates.
    """

    def __init__(self, name: str, apply: Callable[[], Undo]) -> None:
        self.name = name
        self._apply = apply
        self._lock = threading.Lock()
        self._depth = 0
        self._undo: Undo | None = None

    @property
    def active(self) -> bool:
        """True while some ``with`` block (in any thread) holds the patch."""
        with self._lock:
            return self._depth > 0

    def __enter__(self) -> ScopedPatch:
        with self._lock:
            if self._depth == 0:
                self._undo = self._apply()
            self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and self._undo is not None:
                undo, self._undo = self._undo, None
                undo()

    def __repr__(self) -> str:
        return f"ScopedPatch({self.name!r}, depth={self._depth})"


def _disable_gc() -> Undo:
    was_enabled = gc.isenabled()
    gc.disable()
    return gc.enable if was_enabled else (lambda: None)


_GC = ScopedPatch("paused_gc", _disable_gc)


def paused_gc() -> contextlib.AbstractContextManager[ScopedPatch]:
    """No cyclic garbage collection inside the block.

    Why: graph passes allocate hundreds of thousands of short-lived acyclic objects (nodes,
    arg tuples, meta dicts) while the heap holds several copies of a large graph; every
    allocation burst then triggers generation-2 sweeps over the whole heap, which made
    partitioning quadratic in graph size. Reference counting still frees everything acyclic;
    the rest is collected at the first sweep after the block. The collector is re-enabled on
    the last exit only if it was enabled on the first entry.
    """
    return _GC


_quiet_lock = threading.Lock()
_quiet: dict[str, ScopedPatch] = {}


def _silence(name: str) -> Callable[[], Undo]:
    def apply() -> Undo:
        logger = logging.getLogger(name)
        level = logger.level
        logger.setLevel(logging.CRITICAL)
        return lambda: logger.setLevel(level)

    return apply


@contextlib.contextmanager
def quiet_logger(name: str) -> Iterator[None]:
    """Raise logger ``name`` to CRITICAL inside the block and put its level back afterwards
    (the last of any overlapping blocks restores it)."""
    with _quiet_lock:
        patch = _quiet.setdefault(name, ScopedPatch(f"quiet_logger({name})", _silence(name)))
    with patch:
        yield
