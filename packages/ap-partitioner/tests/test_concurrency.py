"""``wait_tensor_dce()`` under concurrency: many threads entering, nesting, leaving and raising.

Invariants: while any thread is inside a scope the waits are absent from torch's side-effect
registry (so DCE may drop them); when every thread has left, torch's registry is exactly what
it was (same members, same set object); a body that raises still restores it.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
import torch.distributed._functional_collectives  # noqa: F401  (registers the waits)
import torch.fx.node
from ap_partitioner import wait_tensor_dce
from ap_testing.concurrency import Boom, hammer

c10d = torch.ops._c10d_functional


def _registry() -> set[object]:
    return torch.fx.node._side_effectful_functions


def test_many_threads_entering_nesting_and_raising_restore_the_registry() -> None:
    registry = _registry()
    before = set(registry)
    violations: list[str] = []

    def body(depth: int, rng: random.Random) -> None:
        if c10d.wait_tensor.default in _registry():
            violations.append("wait_tensor registered while a scope is open")
        if depth < 3 and rng.random() < 0.3:
            with wait_tensor_dce():
                body(depth + 1, rng)
        if rng.random() < 0.25:
            raise Boom()

    def one_round(rng: random.Random) -> None:
        with wait_tensor_dce():
            body(0, rng)

    hammer(one_round, threads=16, rounds=60)
    assert not violations, violations[:3]
    assert not wait_tensor_dce().active
    assert _registry() is registry and set(registry) == before
    assert c10d.wait_tensor.default in registry


def test_dce_inside_scope_in_one_thread_while_another_leaves() -> None:
    """A thread leaving its scope must not re-register the waits under another thread's DCE."""
    inner_entered, outer_left = threading.Event(), threading.Event()
    seen: list[bool] = []

    def long_scope() -> None:
        with wait_tensor_dce():
            inner_entered.set()
            outer_left.wait(timeout=10)
            seen.append(c10d.wait_tensor.default in _registry())

    t = threading.Thread(target=long_scope)
    t.start()
    inner_entered.wait(timeout=10)
    with wait_tensor_dce():
        pass  # a short scope opened and closed while the long one is open
    outer_left.set()
    t.join(timeout=10)
    assert seen == [False]
    assert c10d.wait_tensor.default in _registry() and not wait_tensor_dce().active


def test_exception_escaping_every_level_restores() -> None:
    before = set(_registry())
    with pytest.raises(Boom):
        with wait_tensor_dce():
            with wait_tensor_dce():
                raise Boom()
    assert set(_registry()) == before and not wait_tensor_dce().active
