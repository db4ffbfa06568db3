"""``wait_tensor_dce()``: let dead-code elimination drop unused waits while partitioning.

torch registers ``_c10d_functional.wait_tensor`` (and, from 2.15, ``wait_tensors``) in its
side-effect registry, which ``Node.is_impure`` consults. So plain ``eliminate_dead_code`` keeps a
wait nobody reads, and with it the all-gather and the cast parameter feeding it: extraction then
hands the backward a saved value with no users. While this context is active the waits count as
pure.

Scoping is an :class:`ap_tags.scoped.ScopedPatch`: the first entry removes the registrations and
remembers exactly which it removed; the last exit adds back exactly those. Nestable, safe to
enter from several threads, and the registry is restored even when the body raises.
"""

from __future__ import annotations

from collections.abc import Callable

from ap_tags.scoped import ScopedPatch

from ap_partitioner import _compat


def _waits_pure() -> Callable[[], None]:
    ops = _compat.wait_ops()  # imports functional collectives first, so they are registered
    registry = _compat.side_effect_registry()
    removed = [op for op in ops if op in registry]
    for op in removed:
        registry.discard(op)

    def undo() -> None:
        registry.update(removed)

    return undo


_WAITS_PURE = ScopedPatch("wait_tensor_dce", _waits_pure)


def wait_tensor_dce() -> ScopedPatch:
    """Treat functional-collective waits as pure for DCE inside the ``with`` block (see the
    module doc). ``wait_tensor_dce().active`` says whether any block (in any thread) is open."""
    return _WAITS_PURE
