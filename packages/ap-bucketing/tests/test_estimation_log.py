"""torch's overlap-scheduler estimation table: built only while a structured trace writes it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.fx as fx
from ap_bucketing import BucketingConfig, OverlapBucketingPass
from ap_bucketing._compat import (
    TRACE_LOGGER,
    compute_estimations_log_site,
    structured_trace_writes,
)
from ap_bucketing._estimation_log import estimation_log_only_when_traced
from ap_testing.collectives import backward_like_graph

SITE = compute_estimations_log_site()
pytestmark = pytest.mark.skipif(
    SITE is None, reason="this torch's overlap scheduler builds no estimation table"
)
_c10d = torch.ops._c10d_functional


def _site() -> tuple[Any, str]:
    assert SITE is not None
    return SITE


def _schedule(
    fake_pg: str, monkeypatch: pytest.MonkeyPatch, handlers: list[logging.Handler]
) -> fx.GraphModule:
    """torch's overlap scheduler through the pass, on a small FSDP-like backward, with
    ``handlers`` (and nothing else) on torch's trace logger. Set here, after the process group
    exists: under pytest the logger carries pytest's capture handlers, which would make
    ``trace_structured`` format every artifact."""
    trace = logging.getLogger(TRACE_LOGGER)
    monkeypatch.setattr(trace, "handlers", handlers)
    monkeypatch.setattr(trace, "level", logging.DEBUG)
    gm = backward_like_graph(6, fake_pg)
    config = BucketingConfig(max_topo_span=None, bucket_cap_mb=1000.0, bucket_mode="custom_ops")
    OverlapBucketingPass(config, cpu=True, reorder=True)(gm.graph)
    gm.graph.lint()
    return gm


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """torch's table builder replaced by one that counts its calls (and builds the table)."""
    mod, name = _site()
    original = getattr(mod, name)
    calls: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(len(args[0]))
        return original(*args, **kwargs)

    monkeypatch.setattr(mod, name, counting)
    yield calls


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_the_block_replaces_the_table_builder_and_restores_it_exactly() -> None:
    mod, name = _site()
    original = getattr(mod, name)
    with estimation_log_only_when_traced():
        with estimation_log_only_when_traced():  # nestable
            inside = getattr(mod, name)
        assert getattr(mod, name) is inside
    assert getattr(mod, name) is original
    assert inside is not original
    with pytest.raises(RuntimeError, match="boom"):
        with estimation_log_only_when_traced():
            raise RuntimeError("boom")
    assert getattr(mod, name) is original


def test_a_trace_writes_exactly_while_a_handler_would(monkeypatch: pytest.MonkeyPatch) -> None:
    """No handler: nothing is written. Any handler but torch's own lazy one: written. The lazy
    one without a ``TORCH_TRACE`` directory (an open-source build): it drops itself unwritten."""
    from torch._logging._internal import LazyTraceHandler

    trace = logging.getLogger(TRACE_LOGGER)
    monkeypatch.setattr(trace, "handlers", [])
    assert not structured_trace_writes()
    monkeypatch.setattr(trace, "handlers", [LazyTraceHandler(None)])
    monkeypatch.delenv("MAST_HPC_JOB_NAME", raising=False)
    assert not structured_trace_writes()
    monkeypatch.setattr(trace, "handlers", [LazyTraceHandler("/tmp/some-trace-dir")])
    assert structured_trace_writes()
    monkeypatch.setattr(trace, "handlers", [_Records()])
    assert structured_trace_writes()


def test_the_scheduler_builds_no_table_without_a_trace(
    fake_pg: str, counted: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a ``TORCH_TRACE`` handler the pass schedules (one bucket per direction here)
    and torch's table builder never runs; outside the pass it is torch's own again."""
    gm = _schedule(fake_pg, monkeypatch, [])
    assert len(gm.graph.find_nodes(op="call_function", target=_c10d.reduce_scatter_tensor.default))
    assert counted == []
    mod, name = _site()
    getattr(mod, name)([], [], [])  # the counting stand-in: the block put it back
    assert counted == [0]


def test_the_scheduler_builds_the_table_while_a_trace_writes(
    fake_pg: str, counted: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a handler on torch's trace logger (what ``TORCH_TRACE`` attaches) the table is
    built for the scheduled graph's compute nodes and reaches the trace as torch's artifact."""
    handler = _Records()
    _schedule(fake_pg, monkeypatch, [handler])
    assert counted and all(n > 0 for n in counted), counted
    names = [getattr(r, "metadata", {}).get("artifact", {}).get("name") for r in handler.records]
    assert "fx_compute_nodes_runtime_estimation" in names, names
