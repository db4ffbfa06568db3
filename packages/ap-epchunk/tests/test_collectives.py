"""Early grad accumulation sums parameter-gradient partials before grad communication."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ap_epchunk import ChunkConfig, ChunkError, chunk_pass

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


def test_grad_partials_summed_before_the_collective(fake_graph: Any) -> None:
    gm = _graph(fake_graph)
    report = chunk_pass(gm, ChunkConfig(module_patterns=("layers.*",)))
    gm.graph.lint()
    (region,) = report.regions
    assert region.all_to_alls == 0
    assert region.whole_collectives == ["all_reduce: replayed once on the summed chunk partials"]
    nodes = list(gm.graph.nodes)
    reduces = [n for n in nodes if n.target is c10d.all_reduce.default]
    waits = [n for n in nodes if n.target is c10d.wait_tensor.default]
    out = next(iter(gm.graph.find_nodes(op="output"))).args[0][0]
    # one all_reduce, of the summed partials; the dead per-chunk copies are gone
    assert len(reduces) == len(waits) == 1
    assert reduces[0].args[0].target is aten.add.Tensor
    assert out is waits[0]
    assert report.summed == ["mm_default"]


def _forward_all_reduce(fake_graph: Any) -> torch.fx.GraphModule:
    """A data-parallel all_reduce of a token-carrying value inside a chunked region."""
    b = fake_graph()
    u0 = b.unbacked(8)
    x = b.placeholder("x", b.fake(u0, 3))
    h = b.op(aten.relu.default, x, fqn="layers.0")
    red = b.op(c10d.all_reduce.default, h, "sum", "0", fqn="layers.0")
    done = b.op(c10d.wait_tensor.default, red, fqn="layers.0")
    return b.module(b.op(aten.relu.default, done, fqn="head"))


@pytest.mark.parametrize(
    ("build", "early_grad_accumulation", "match"),
    [
        # without early accumulation the gradient all-reduce would silently become one
        # all-reduce per chunk
        (_graph, False, r"collective _c10d_functional::all_reduce inside chunked"),
        (_forward_all_reduce, True, r"node 'all_reduce_default': collective"),
    ],
    ids=["grad_all_reduce_without_early_accumulation", "forward_all_reduce_of_tokens"],
)
def test_collective_that_would_run_per_chunk_is_refused(
    fake_graph: Any, build: Any, early_grad_accumulation: bool, match: str
) -> None:
    """Policy: only EP all-to-alls run once per chunk; any other collective inside a chunked
    region is refused and the graph is left unchanged."""
    gm = build(fake_graph)
    before = gm.code
    config = ChunkConfig(("layers.*",), early_grad_accumulation=early_grad_accumulation)
    with pytest.raises(ChunkError, match=match):
        chunk_pass(gm, config)
    assert gm.code == before


def test_all_to_all_is_chunked(fake_graph: Any) -> None:
    """The EP token exchange runs once per chunk: what chunking is for."""
    b = fake_graph()
    u0 = b.unbacked(8)
    x = b.placeholder("x", b.fake(u0, 3))
    h = b.op(aten.relu.default, x, fqn="layers.0")
    a2a = b.op(c10d.all_to_all_single.default, h, [u0], [u0], "0", fqn="layers.0")
    done = b.op(c10d.wait_tensor.default, a2a, fqn="layers.0")
    out = b.op(aten.relu.default, done, fqn="head")
    gm = b.module(out)
    report = chunk_pass(gm, ChunkConfig(module_patterns=("layers.*",)))
    gm.graph.lint()
    assert [(r.all_to_alls, r.whole_collectives) for r in report.regions] == [(1, [])]
    a2as = [n for n in gm.graph.nodes if n.target is c10d.all_to_all_single.default]
    assert len(a2as) == 2
    # the split sizes are the chunk's own extent, not the full one
    for a in a2as:
        out_split, in_split = (
            v.meta["val"] if isinstance(v, torch.fx.Node) else v
            for v in (a.args[1][0], a.args[2][0])
        )
        assert str(out_split) == str(in_split) == str(a.meta["val"].shape[0])
        assert str(out_split) != str(u0)
