"""Real Inductor CPU codegen with ``SaveAllPartitioner`` as ``custom_partitioner_fn``."""

from __future__ import annotations

import contextlib
from typing import Any

import ap_tags
import pytest
import torch
import torch.nn as nn
from ap_partitioner import PartitionReport, SaveAllPartitioner


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)).sin()).pow(2).mean()


class FirstCompiled(nn.Module):
    def __init__(self, model: nn.Module, fn: Any, order: list[str]) -> None:
        super().__init__()
        self.model, self.fn, self.order = model, fn, order

    def forward(self, x: torch.Tensor) -> Any:
        params = dict(self.model.named_parameters())
        return self.fn(*[params[n] for n in self.order], x)


@pytest.mark.slow
def test_inductor_forward_backward_with_save_all() -> None:
    from torch._functorch.aot_autograd import (
        aot_compile_joint_with_descriptors,
        aot_export_joint_with_descriptors,
    )
    from torch._functorch.partitioners import default_partition

    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 16)
    with contextlib.ExitStack() as stack:
        jd = aot_export_joint_with_descriptors(stack, model, (x,))
        fn = aot_compile_joint_with_descriptors(
            jd,
            partition_fn=default_partition,
            fw_compiler=ap_tags.preserve_meta_compiler(tag_forward=True),
            bw_compiler=ap_tags.preserve_meta_compiler(),
        )
        order = list(jd.params_spec)
    first = FirstCompiled(model, fn, order)

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
