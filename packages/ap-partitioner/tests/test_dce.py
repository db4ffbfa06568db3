"""``wait_tensor_dce()``: unused waits become DCE-able; torch's registry is restored exactly."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed._functional_collectives  # noqa: F401  (registers the waits)
import torch.fx as fx
import torch.fx.node
from ap_partitioner import wait_tensor_dce

c10d = torch.ops._c10d_functional


def _snapshot() -> set[object]:
    return set(torch.fx.node._side_effectful_functions)


def _graph_with_unused_wait() -> fx.Graph:
    g = fx.Graph()
    x = g.placeholder("primals_1")
    ag = g.call_function(c10d.all_gather_into_tensor.default, (x, 8, "0"))
    g.call_function(c10d.wait_tensor.default, (ag,))
    g.output((x,))
    return g


def test_unused_wait_is_kept_by_default_and_dropped_inside() -> None:
    g = _graph_with_unused_wait()
    g.eliminate_dead_code()
    assert any(n.target is c10d.wait_tensor.default for n in g.nodes)
    with wait_tensor_dce():
        wait = next(n for n in g.nodes if n.target is c10d.wait_tensor.default)
        assert not wait.is_impure()
        g.eliminate_dead_code()
    assert [n.op for n in g.nodes] == ["placeholder", "output"]


def test_registry_restored_exactly_and_waits_impure_again() -> None:
    before = _snapshot()
    with wait_tensor_dce():
        inside = _snapshot()
        assert c10d.wait_tensor.default not in inside and c10d.wait_tensor not in inside
        if hasattr(c10d, "wait_tensors"):
            assert c10d.wait_tensors.default not in inside
        assert before - inside <= {
            c10d.wait_tensor,
            c10d.wait_tensor.default,
            *(
                (c10d.wait_tensors, c10d.wait_tensors.default)
                if hasattr(c10d, "wait_tensors")
                else ()
            ),
        }
    assert _snapshot() == before
    g = _graph_with_unused_wait()
    assert next(n for n in g.nodes if n.target is c10d.wait_tensor.default).is_impure()


def test_restored_when_the_body_raises() -> None:
    before = _snapshot()
    with pytest.raises(ValueError), wait_tensor_dce():
        raise ValueError("boom")
    assert _snapshot() == before and not wait_tensor_dce().active


def test_nested_exit_keeps_the_outer_scope_active() -> None:
    before = _snapshot()
    with wait_tensor_dce():
        with wait_tensor_dce():
            pass
        assert c10d.wait_tensor.default not in torch.fx.node._side_effectful_functions
    assert _snapshot() == before


def test_does_not_re_add_what_was_not_registered() -> None:
    registry = torch.fx.node._side_effectful_functions
    registry.discard(c10d.wait_tensor)  # simulate a torch that registers only the overload
    try:
        with wait_tensor_dce():
            pass
        assert c10d.wait_tensor not in registry
        assert c10d.wait_tensor.default in registry
    finally:
        registry.add(c10d.wait_tensor)


def test_threads_share_one_refcounted_scope() -> None:
    before = _snapshot()
    entered, release = threading.Barrier(3), threading.Event()

    def worker() -> None:
        with wait_tensor_dce():
            entered.wait()
            release.wait()

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    entered.wait()
    assert c10d.wait_tensor.default not in torch.fx.node._side_effectful_functions
    release.set()
    for t in threads:
        t.join()
    assert _snapshot() == before and not wait_tensor_dce().active
