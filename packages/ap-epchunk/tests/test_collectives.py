"""Early grad accumulation sums parameter-gradient partials before grad communication."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ap_epchunk import ChunkConfig, chunk_pass

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _graph(fake_graph: Any) -> torch.fx.GraphModule:
    # grad_w = mm(x.t(), grad_out) -> all_reduce -> wait -> output  (backward of layers.0)
    b = fake_graph()
    u0 = b.unbacked(8)
    x = b.placeholder("x", b.fake(u0, 3))
    g = b.placeholder("grad_out", b.fake(u0, 3))
    xt = b.op(aten.t.default, x, fqn="layers.0", backward=True)
    gw = b.op(aten.mm.default, xt, g, fqn="layers.0", backward=True)
    red = b.op(c10d.all_reduce.default, gw, "sum", "0", fqn="layers.0", backward=True)
    done = b.op(c10d.wait_tensor.default, red, fqn="layers.0", backward=True)
    return b.module(done)


@pytest.mark.parametrize("early", [True, False])
def test_grad_partials_summed_before_the_collective(early: bool, fake_graph: Any) -> None:
    gm = _graph(fake_graph)
    report = chunk_pass(
        gm, ChunkConfig(module_patterns=("layers.*",), early_grad_accumulation=early)
    )
    gm.graph.lint()
    nodes = list(gm.graph.nodes)
    reduces = [n for n in nodes if n.target is c10d.all_reduce.default]
    waits = [n for n in nodes if n.target is c10d.wait_tensor.default]
    out = next(iter(gm.graph.find_nodes(op="output"))).args[0][0]
    if early:  # one all_reduce, of the summed partials
        assert len(reduces) == len(waits) == 1
        assert reduces[0].args[0].target is aten.add.Tensor
        assert out is waits[0]
        assert report.summed == ["mm_default"]
    else:  # per-chunk collectives, summed in chunk order where the value escapes
        assert len(reduces) == len(waits) == 2
        assert out.target is aten.add.Tensor
        assert [a.name for a in out.args] == [
            "wait_tensor_default_chunk1",
            "wait_tensor_default_chunk0",
        ]
