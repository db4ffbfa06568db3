"""Real Inductor CPU codegen with ``SaveAllPartitioner`` as ``custom_partitioner_fn``."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from ap_partitioner import PartitionReport, SaveAllPartitioner
from ap_testing.two_stage import first_compile


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)).sin()).pow(2).mean()


@pytest.mark.slow
def test_inductor_forward_backward_with_save_all() -> None:
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 16)
    first = first_compile(model, x).module

    reports: list[PartitionReport] = []
    torch._dynamo.reset()
    partitioner = SaveAllPartitioner(strict=True, on_report=reports.append)
    with torch._inductor.config.patch(custom_partitioner_fn=partitioner):
        compiled = torch.compile(first, backend="inductor", fullgraph=True)
        loss = compiled(x)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    model.zero_grad()
    expected = model(x)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for got, want in zip(grads, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(got, want)
    assert len(reports) == 1 and not reports[0].fell_back
    assert reports[0].saved_activation_count > 0  # replayed the first partition's saves
