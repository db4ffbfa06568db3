"""``wait_tensor_dce()``: let dead-code elimination drop unused waits while partitioning.

torch registers ``_c10d_functional.wait_tensor`` (and, from 2.15, ``wait_tensors``) in the
private set ``torch.fx.node._side_effectful_functions``; ``Node.is_impure`` consults that set
(2.13-2.15 all delegate to ``torch._library.utils.is_impure``, which checks both the packet and
the overload). So plain ``eliminate_dead_code`` keeps a wait nobody reads, and with it the
all-gather and the cast parameter feeding it: extraction then hands the backward a saved value
with no users. While this context is active the waits count as pure.

Scoping: the first entry removes the registrations and remembers exactly which it removed; the
last exit adds back exactly those. A lock and a depth counter make it nestable and safe to
enter from several threads; the registry is restored even when the body raises.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.fx.node

from ap_partitioner import _compat

_lock = threading.Lock()
_depth = 0
_removed: list[Any] = []


def _registry() -> set[Any]:
    registry = getattr(torch.fx.node, "_side_effectful_functions", None)
    if not isinstance(registry, set):
        raise _compat.UnsupportedTorchError(
            f"wait_tensor_dce needs torch{_compat.SUPPORTED_TORCH}: "
            "torch.fx.node._side_effectful_functions is missing or not a set"
        )
    return registry


def _enter() -> None:
    global _depth
    ops = _compat.wait_ops()  # imports functional collectives first, so they are registered
    with _lock:
        if _depth == 0:
            registry = _registry()
            _removed[:] = [op for op in ops if op in registry]
            for op in _removed:
                registry.discard(op)
        _depth += 1


def _exit() -> None:
    global _depth
    with _lock:
        _depth -= 1
        if _depth == 0:
            _registry().update(_removed)
            _removed.clear()


def is_active() -> bool:
    """True while some ``wait_tensor_dce()`` context is open (in any thread)."""
    with _lock:
        return _depth > 0


@contextmanager
def wait_tensor_dce() -> Iterator[None]:
    """Treat functional-collective waits as pure for DCE inside the block (see module doc)."""
    _enter()
    try:
        yield
    finally:
        _exit()
