"""Hammering process-wide scoped patches from many threads at once.

Every scoped patch in the workspace (``ap_tags.scoped.ScopedPatch``, ap-bucketing's
``patched``/``install``, ``wait_tensor_dce``) promises: nestable, thread-safe, restored exactly
even when the body raises. ``hammer`` is the one driver their tests share.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

__all__ = ["Boom", "hammer"]


class Boom(Exception):
    """Raised on purpose inside a scope, to check the scope is left cleanly anyway."""


def hammer(
    round_fn: Callable[[random.Random], None],
    *,
    threads: int = 8,
    rounds: int = 200,
    timeout_s: float = 120.0,
) -> None:
    """Run ``round_fn(rng)`` ``rounds`` times on each of ``threads`` threads started together
    (thread ``i`` seeds its ``random.Random`` with ``i``). A :class:`Boom` escaping a round is
    expected and swallowed; any other exception, or a thread still running after
    ``timeout_s``, fails with the first few errors."""
    start = threading.Barrier(threads)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        start.wait()
        try:
            for _ in range(rounds):
                try:
                    round_fn(rng)
                except Boom:
                    pass
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread
            errors.append(exc)

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=timeout_s)
    alive = [t.name for t in pool if t.is_alive()]
    assert not alive, f"threads still running after {timeout_s:.0f} s: {alive}"
    assert not errors, errors[:3]
