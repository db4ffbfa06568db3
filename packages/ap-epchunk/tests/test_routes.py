"""A chunk plan whose bodies bind unbacked symbols (``.tolist()`` split sizes) is refused at
compile time on a joint graph AOTAutograd traced from Dynamo without ``precompile`` (it used to
compile and then fail at run time; issue 34, item 2) -- and accepted from ``trace_joint`` or a
precompiled module's second compilation."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ap_epchunk import ChunkConfig, ChunkError, chunk_pass
from ap_epchunk._errors import BACKWARD_FQN_KEY
from ap_testing.graphs import snapshot

desc = pytest.importorskip("torch._functorch._aot_autograd.descriptors")
aten = torch.ops.aten
CFG = ChunkConfig(module_patterns=("layers.*",))


def _graph(fake_graph: Any, *, described: bool, stamped: bool) -> torch.fx.GraphModule:
    """``layers.0``: ``n = x.sum().item()`` and ``relu(x) + n``; a backward op outside it."""
    b = fake_graph()
    u0 = b.unbacked(8)
    x = b.placeholder("x", b.fake(u0, 4))
    if described:
        x.meta["desc"] = desc.PlainAOTInput(0)
    s = b.op(aten.sum.default, x, fqn="layers.0")
    item = b.graph.call_function(aten._local_scalar_dense.default, (s,))
    n = b.unbacked(3)
    item.meta.update(val=n, unbacked_bindings={n.node.expr: ()}, custom={"module_fqn": "layers.0"})
    r = b.op(aten.relu.default, x, fqn="layers.0")
    out = b.op(aten.add.Tensor, r, item, fqn="layers.0")
    bw = b.op(aten.neg.default, out, fqn="head", backward=True)
    if stamped:
        bw.meta["custom"] = {**bw.meta["custom"], BACKWARD_FQN_KEY: "head"}
    return b.module(out, bw)


def test_dynamo_graph_without_first_compilation_is_refused_untouched(fake_graph: Any) -> None:
    gm = _graph(fake_graph, described=True, stamped=False)
    before = snapshot(gm)
    with pytest.raises(ChunkError) as e:
        chunk_pass(gm, CFG)
    msg = str(e.value)
    assert msg.startswith("node '_local_scalar_dense_default': data-dependent op in chunked")
    assert "ap_backend.precompile(module, example_args)" in msg
    assert "mark_chunk_dim(t, 0, hint=t.shape[0])" in msg
    assert snapshot(gm) == before


@pytest.mark.parametrize(
    ("described", "stamped"), [(False, False), (True, True)], ids=["trace_joint", "precompiled"]
)
def test_trace_joint_and_precompiled_graphs_are_chunked(
    fake_graph: Any, described: bool, stamped: bool
) -> None:
    gm = _graph(fake_graph, described=described, stamped=stamped)
    report = chunk_pass(gm, CFG)
    assert report.regions[0].root == "layers.0" and report.concatenated == ["add_tensor"]
