"""``precompile``'s first compilation prints its graphs only for a reader.

AOTAutograd's joint compile builds the joint, forward and backward graphs' full text for its
cache entry and its logs whether or not anything takes it; the export route's compile is never
cached, so ``precompile`` switches that off (``_compat.unprinted_joint_compile``) unless
``TORCH_TRACE`` is on or ``TORCH_LOGS`` asks for AOTAutograd's graphs. Held here: no graph text
without a reader, the text (and tlparse's ``aot_joint_graph``) with one, and the same partition
and numerics either way.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from ap_backend import _compat, precompile
from torch import nn


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(self.up(x).relu()).sum()
        return out


_TRACE = "torch.__trace"


def _no_trace_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    """No reader of torch's structured trace but torch's own idle ``LazyTraceHandler``.
    Called in the test body: pytest's log capture attaches its handlers to that logger when
    the test's call starts, after its fixtures ran (they read the trace, so they count)."""
    logger = logging.getLogger(_TRACE)
    idle = [h for h in logger.handlers if type(h).__name__ == "LazyTraceHandler"]
    monkeypatch.setattr(logger, "handlers", idle)
    assert not _compat.structured_tracing()


@pytest.fixture
def printed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the graph modules whose text was built (``print_readable``)."""
    seen: list[str] = []
    real = torch.fx.GraphModule.print_readable

    def spy(self: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> str:
        seen.append(type(self).__name__)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.fx.GraphModule, "print_readable", spy)
    return seen


@pytest.fixture
def structured_trace() -> Iterator[list[logging.LogRecord]]:
    """``TORCH_TRACE`` on, as far as torch's ``trace_structured`` can tell: a handler on its
    logger, collecting what it writes."""

    class _Collect(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.records: list[logging.LogRecord] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.records.append(record)

    logger = logging.getLogger(_TRACE)
    handler = _Collect()
    logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)


def _first(model: nn.Module, x: torch.Tensor) -> Any:
    return precompile(model, (x,), first_compilation_cache=False)


def test_an_idle_lazy_trace_handler_is_no_reader() -> None:
    from torch._logging._internal import LazyTraceHandler

    logger = logging.getLogger(_TRACE)
    saved = list(logger.handlers)
    try:
        logger.handlers = [LazyTraceHandler(None)]
        assert not _compat.structured_tracing()  # open-source torch, no TORCH_TRACE
        logger.handlers = [LazyTraceHandler("/tmp/ap-trace-dir")]
        assert _compat.structured_tracing()
        logger.handlers = [logging.NullHandler()]
        assert _compat.structured_tracing()
        logger.handlers = []
        assert not _compat.structured_tracing()
    finally:
        logger.handlers = saved


def test_no_graph_text_is_made_without_a_reader(
    printed: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_trace_reader(monkeypatch)
    torch.manual_seed(0)
    model, x = _Mlp(), torch.randn(4, 16)
    pm = _first(model, x)
    assert printed == []
    # the first compilation is whole: its partition and its training are the module's
    assert pm.first_partition.nbytes > 0
    loss = pm(x)
    loss.backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).backward()
    for g, want in zip(got, [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(g, want)


def test_a_structured_trace_still_gets_the_graphs(
    printed: list[str], structured_trace: list[logging.LogRecord]
) -> None:
    assert _compat.structured_tracing()
    torch.manual_seed(0)
    model, x = _Mlp(), torch.randn(4, 16)
    _first(model, x)
    assert len(printed) >= 3  # the joint, the forward and the backward
    names = [str(getattr(r, "metadata", r.msg)) for r in structured_trace]
    assert any("aot_joint_graph" in n for n in names), names[:20]


def test_torch_logs_for_aot_graphs_still_get_them(
    printed: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_trace_reader(monkeypatch)
    torch._logging.set_logs(aot_graphs=True)
    try:
        torch.manual_seed(0)
        _first(_Mlp(), torch.randn(4, 16))
    finally:
        torch._logging.set_logs()
    assert len(printed) >= 2  # the forward and the backward


def test_the_partition_does_not_depend_on_the_text(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model, x = _Mlp(), torch.randn(4, 16)
    with monkeypatch.context() as quiet_logs:
        _no_trace_reader(quiet_logs)
        quiet = _first(model, x).first_partition
    logger = logging.getLogger(_TRACE)
    handler = logging.NullHandler()
    logger.addHandler(handler)
    try:
        traced = _first(model, x).first_partition
    finally:
        logger.removeHandler(handler)
    assert quiet == traced
