"""The process-wide changes ap-epchunk makes are scoped: nestable, thread-safe, undone exactly
(also when the body raises), and visible only inside their scope.

* ``trace_joint``'s ``backward_provenance`` swaps ``torch.autograd.grad`` and
  ``torch.Tensor.backward``;
* the static-shape probe silences torch's fake-tensor logger;
* ``chunk_pass`` and ``concretize_chunk_symbols`` pause the cyclic garbage collector.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.fx.traceback as fx_traceback
from ap_epchunk import (
    ChunkConfig,
    ChunkError,
    _concretize,
    _passes,
    _static_shapes,
    _tracing,
    chunk_pass,
    concretize_chunk_symbols,
)
from ap_epchunk._compat import FAKE_TENSOR_LOGGER
from ap_epchunk._tracing import backward_provenance
from ap_testing.chunking import Stack
from ap_testing.concurrency import Boom, hammer
from torch.fx.experimental.proxy_tensor import make_fx

ORIGINAL_GRAD = torch.autograd.grad
ORIGINAL_BACKWARD = torch.Tensor.backward


def _originals_in_place() -> bool:
    return torch.autograd.grad is ORIGINAL_GRAD and torch.Tensor.backward is ORIGINAL_BACKWARD


@pytest.fixture(autouse=True)
def _starts_and_ends_unpatched() -> Iterator[None]:
    assert _originals_in_place()
    yield
    assert _originals_in_place(), "a backward_provenance scope leaked its swap"
    assert not _tracing._AUTOGRAD_PATCH.active


def _backward_marks(inside: bool) -> int:
    """How many nodes of a traced ``autograd.grad`` step are marked as backward."""

    def step(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(x.sin().sum(), [x])

    scope = backward_provenance() if inside else contextlib.nullcontext()
    with scope, fx_traceback.preserve_node_meta():
        gm = make_fx(step)(torch.randn(3, requires_grad=True))
    return sum(1 for n in gm.graph.nodes if n.meta.get("autograd_backward") is True)


def test_swap_is_visible_only_inside_the_scope() -> None:
    assert _backward_marks(inside=False) == 0
    with backward_provenance():
        assert torch.autograd.grad is not ORIGINAL_GRAD
        assert torch.Tensor.backward is not ORIGINAL_BACKWARD
        assert torch.autograd.grad.__wrapped__ is ORIGINAL_GRAD  # type: ignore[attr-defined]
    assert _originals_in_place()
    assert _backward_marks(inside=True) > 0  # the swap is what marks the backward
    assert _backward_marks(inside=False) == 0  # and nothing of it is left afterwards


def test_threads_outside_a_scope_are_not_marked(monkeypatch: pytest.MonkeyPatch) -> None:
    """While one thread traces, the swapped functions are process-wide, but an unrelated
    ``autograd.grad`` in another thread installs no hooks."""
    marked: list[str] = []
    monkeypatch.setattr(
        _tracing,
        "_install_backward_meta_hooks",
        lambda outputs: marked.append(threading.current_thread().name),
    )
    entered, release = threading.Event(), threading.Event()

    def tracer() -> None:
        with backward_provenance():
            x = torch.randn(2, requires_grad=True)
            torch.autograd.grad(x.sum(), [x])
            entered.set()
            release.wait(30)

    thread = threading.Thread(target=tracer, name="tracer")
    thread.start()
    try:
        assert entered.wait(30)
        assert torch.autograd.grad is not ORIGINAL_GRAD  # process-wide while held
        x = torch.randn(2, requires_grad=True)
        torch.autograd.grad(x.sum(), [x])
        (x * 2).sum().backward()
    finally:
        release.set()
        thread.join(30)
    assert marked == ["tracer"]


def test_exception_inside_restores() -> None:
    with pytest.raises(Boom), backward_provenance():
        raise Boom
    assert _originals_in_place()
    with backward_provenance():
        with pytest.raises(Boom), backward_provenance():
            raise Boom
        assert torch.autograd.grad is not ORIGINAL_GRAD  # the outer scope still holds it
        assert _tracing._in_scope()
    assert not _tracing._in_scope()


def test_nested_and_concurrent_scopes_restore_exactly() -> None:
    def round_fn(rng: random.Random) -> None:
        depth = rng.randint(1, 3)
        with contextlib.ExitStack() as stack:
            for _ in range(depth):
                stack.enter_context(backward_provenance())
                assert torch.autograd.grad is not ORIGINAL_GRAD
                assert torch.Tensor.backward is not ORIGINAL_BACKWARD
                assert _tracing._in_scope()
            if rng.random() < 0.1:
                x = torch.randn(2, requires_grad=True)
                torch.autograd.grad(x.sum(), [x])
            if rng.random() < 0.2:
                raise Boom
        assert not _tracing._in_scope()

    hammer(round_fn, threads=8, rounds=150)
    assert _originals_in_place()


# ----------------------------------------------------------------------------- logger and gc


@pytest.fixture
def static_graph(trace: Any) -> torch.fx.GraphModule:
    torch.manual_seed(0)
    return trace(Stack(4, 1), torch.randn(4, 4), torch.randn(4, 4), symbolic=False)  # type: ignore[no-any-return]


STATIC = ChunkConfig(module_patterns=("layers.*",), chunk_inputs=("x_1", "y_1"))


@pytest.mark.parametrize("fails", [False, True], ids=["ok", "probe_raises"])
def test_probe_silences_the_fake_tensor_logger_only_inside(
    static_graph: torch.fx.GraphModule, monkeypatch: pytest.MonkeyPatch, fails: bool
) -> None:
    logger = logging.getLogger(FAKE_TENSOR_LOGGER)
    previous = logger.level
    logger.setLevel(logging.INFO)
    seen: list[int] = []
    probe_all = _static_shapes.StaticShapes._probe_all

    def spy(self: Any, graph: torch.fx.Graph) -> None:
        seen.append(logger.level)
        if fails:
            raise Boom
        probe_all(self, graph)

    monkeypatch.setattr(_static_shapes.StaticShapes, "_probe_all", spy)
    try:
        with pytest.raises(Boom) if fails else contextlib.nullcontext():
            chunk_pass(static_graph, STATIC)
        assert seen == [logging.CRITICAL]
        assert logger.level == logging.INFO
    finally:
        logger.setLevel(previous)


@pytest.mark.parametrize("refused", [False, True], ids=["ok", "refused"])
def test_passes_pause_the_garbage_collector_only_inside(
    static_graph: torch.fx.GraphModule, monkeypatch: pytest.MonkeyPatch, refused: bool
) -> None:
    enabled: list[bool] = []

    def spy_on(module: Any, name: str) -> None:
        inner = getattr(module, name)

        def spy(*args: Any) -> Any:
            enabled.append(gc.isenabled())
            return inner(*args)

        monkeypatch.setattr(module, name, spy)

    spy_on(_passes, "_chunk_pass")
    spy_on(_concretize, "_concretize")
    assert gc.isenabled()
    config = STATIC.replace(module_patterns=("nope.*",)) if refused else STATIC
    with pytest.raises(ChunkError) if refused else contextlib.nullcontext():
        chunk_pass(static_graph, config)
    concretize_chunk_symbols(static_graph)
    assert enabled == [False, False]
    assert gc.isenabled()
