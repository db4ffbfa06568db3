"""Fallbacks keep training alive: invalid tags on a real model -> min-cut, a warning, same numbers.

A small MLP is compiled with ``torch.compile`` through AOTAutograd (identity fw/bw compilers,
``SaveAllPartitioner`` as the partition function) and trained for a few SGD steps next to an
eager copy. The tags are deliberately broken in two ways:

* malformed: the forward runs inside ``torch.fx.traceback.annotate({"ap_must_save": "yes"})``,
  so every joint node carries a non-bool ``ap_must_save`` (``validate_tags`` refuses it);
* not a valid cut: a joint pass tags every parameter ``MUST_RECOMPUTE`` and nothing is saved,
  so the backward needs values that are neither saved nor recomputable.

Either way the partitioner must fall back to min-cut, log a warning naming the reason, report
``fell_back``, and the losses and parameters must match eager.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.fx.traceback as fx_traceback
from ap_partitioner import PartitionReport, SaveAllPartitioner
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch.utils.checkpoint import CheckpointPolicy

STEPS = 3


class MLP(torch.nn.Module):
    def __init__(self, annotate_bad_tags: bool = False) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)
        self.annotate_bad_tags = annotate_bad_tags

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if self.annotate_bad_tags:
            ctx = fx_traceback.annotate({"ap_must_save": "yes"})
        with ctx:
            return self.fc2(torch.relu(self.fc1(x))).sum(dim=1)


def _identity(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    return make_boxed_func(gm.forward)


def _break_the_cut(gm: torch.fx.GraphModule, joint_inputs: Any, **kw: Any) -> Any:
    """Mark every parameter MUST_RECOMPUTE: the replay can save no input the backward reads."""
    for node in gm.graph.find_nodes(op="placeholder"):
        if str(node.target).startswith("primals"):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return gm


def _train(
    model: torch.nn.Module, compiled: Callable[[torch.Tensor], torch.Tensor], data: torch.Tensor
) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = compiled(data[step]).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@contextlib.contextmanager
def _partitioner_with(
    pre: Callable[..., Any] | None,
) -> Iterator[tuple[Any, list[PartitionReport]]]:
    reports: list[PartitionReport] = []
    save_all = SaveAllPartitioner(on_report=reports.append)

    def partition_fn(gm: torch.fx.GraphModule, joint_inputs: Any, **kw: Any) -> Any:
        if pre is not None:
            pre(gm, joint_inputs)
        return save_all(gm, joint_inputs, **kw)

    torch._dynamo.reset()
    try:
        yield (
            aot_autograd(fw_compiler=_identity, bw_compiler=_identity, partition_fn=partition_fn),
            reports,
        )
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("breakage", ["malformed_tags", "invalid_cut"])
def test_invalid_tags_fall_back_to_min_cut_and_training_matches_eager(
    breakage: str, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    data = torch.randn(STEPS, 5, 8)
    eager = MLP()
    model = MLP(annotate_bad_tags=breakage == "malformed_tags")
    model.load_state_dict(eager.state_dict())
    pre = _break_the_cut if breakage == "invalid_cut" else None
    with (
        caplog.at_level(logging.WARNING, logger="ap_partitioner"),
        _partitioner_with(pre) as (backend, reports),
    ):
        got = _train(model, torch.compile(model, backend=backend, fullgraph=True), data)
    want = _train(eager, eager, data)

    assert reports, "the partitioner never ran"
    assert all(r.fell_back for r in reports)
    reason = reports[0].fallback_reason or ""
    if breakage == "malformed_tags":
        assert "malformed tags" in reason and "ap_must_save" in reason
    else:
        assert "not a valid cut" in reason and "primals" in reason
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("min-cut" in w for w in warnings), warnings
    torch.testing.assert_close(got, want)
    for p_got, p_want in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p_got, p_want)


def test_valid_tags_do_not_fall_back() -> None:
    """Control: the same model without broken tags is replayed, not delegated to min-cut."""
    torch.manual_seed(0)
    data = torch.randn(STEPS, 5, 8)
    eager, model = MLP(), MLP()
    model.load_state_dict(eager.state_dict())
    with _partitioner_with(None) as (backend, reports):
        got = _train(model, torch.compile(model, backend=backend, fullgraph=True), data)
    want = _train(eager, eager, data)
    assert reports and not any(r.fell_back for r in reports)
    torch.testing.assert_close(got, want)
