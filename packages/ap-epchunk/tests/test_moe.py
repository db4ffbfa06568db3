"""A small MoE block: router, top-k gating, experts and an in-place tokens_per_expert buffer."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ap_epchunk import ChunkConfig, chunk_pass, concretize_chunk_symbols
from ap_testing.chunking import MoEBlock, Stack, run_joint

aten = torch.ops.aten
D = 8


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "unbacked"])
def test_moe_chunking_equals_eager_chunking(
    symbolic: bool, trace: Any, run_eager_chunked: Any
) -> None:
    torch.manual_seed(0)
    model = Stack(D, 2, MoEBlock)
    x, y = torch.randn(8, D), torch.randn(8, D)
    gm = trace(model, x, y, symbolic=symbolic)
    unchunked, unchunked_buffers = run_joint(gm, model, x, y)
    report = chunk_pass(
        gm,
        ChunkConfig(
            module_patterns=("layers.*.moe",),
            num_chunks=2,
            early_grad_accumulation=False,
            chunk_inputs=() if symbolic else ("x_1", "y_1"),
        ),
    )
    assert {(r.root, r.backward) for r in report.regions} == {
        (f"layers.{i}.moe", bw) for i in range(2) for bw in (False, True)
    }
    # the buffer update runs per chunk, chunk 1 mutating the result of chunk 0
    adds = [n for n in gm.graph.nodes if n.target is aten.add_.Tensor]
    assert len(adds) == 4
    for first, second in zip(adds[::2], adds[1::2], strict=True):
        assert second.args[0] is first and first.args[0].op == "placeholder"
    assert len(report.mutation_chains) == 0  # the add_ results have no full users
    if symbolic:
        concretize_chunk_symbols(gm)
    out, buffers = run_joint(gm, model, x, y)
    eager, eager_buffers = run_eager_chunked(model, "layers", "moe", x, y, 2)
    for got, want, full in zip(out, eager, unchunked, strict=True):
        assert torch.equal(got, want)
        torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-6)
    assert buffers.keys() == eager_buffers.keys() == unchunked_buffers.keys()
    for name, value in buffers.items():
        assert torch.equal(value, eager_buffers[name]), name
        assert torch.equal(value, unchunked_buffers[name]), name
    gm.graph.lint()
