"""One torch module attribute replaced while a block is open: nestable, thread-safe, exact.

Why one mechanism: ap-bucketing swaps two torch functions for the duration of its pass (the
overlap scheduler's GPU-only estimator, ``_cpu_estimation``; its estimation-table builder,
``_estimation_log``), and both need the same guarantees: nested and concurrent blocks share one
replacement, the exact original is put back when the last block closes (however it exits), and
a site someone else replaced in the meantime is left as they set it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

__all__ = ["ScopedReplacement"]


class ScopedReplacement:
    """``site()``'s attribute (``(module, name)``, or ``None`` when this torch has none: then a
    block changes nothing) replaced by ``replacement`` while at least one :meth:`block` is
    open. ``original`` is what the attribute was when the first block opened (``None`` outside
    any block), for a replacement that delegates to it."""

    def __init__(
        self,
        site: Callable[[], tuple[ModuleType, str] | None],
        replacement: Callable[..., Any],
    ) -> None:
        self._site = site
        self._replacement = replacement
        self._lock = threading.Lock()
        self._depth = 0
        self.original: Any = None

    @contextlib.contextmanager
    def block(self) -> Iterator[None]:
        """Replace the attribute for the block (nestable); ``site()`` raising leaves it as it
        was."""
        site = self._site()
        if site is None:
            yield
            return
        mod, name = site
        with self._lock:
            if self._depth == 0:
                self.original = getattr(mod, name)
                setattr(mod, name, self._replacement)
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    if getattr(mod, name) is self._replacement:
                        setattr(mod, name, self.original)
                    self.original = None
