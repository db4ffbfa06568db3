"""Static-size chunking (``chunk_inputs`` / ``mark_chunk_dim(t, dim, hint=None)``) of the two
full-batch values a training step's backward starts from (issue 34, item 3):

* the gradient of a scalar loss broadcast to the batch shape (``expand(g, [8, 4])``): chunked
  like a creation op, along the broadcast dim its consumer needs;
* a tangent of a joint graph (the loss computed outside the compiled module): chunk-sized
  along the dim of the forward output it is the gradient of (AOTAutograd's descriptors).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ap_epchunk import ChunkConfig, chunk_pass
from ap_epchunk._tangents import tangent_outputs
from ap_testing.graphs import snapshot

aten = torch.ops.aten
CFG = ChunkConfig(module_patterns=("layers.*",), chunk_inputs=("x",))


def _scalar_loss_backward(fake_graph: Any) -> torch.fx.GraphModule:
    """``h = relu(x) * w`` in ``layers.0``; the backward of ``h.sum()`` outside it:
    ``expand(g, [8, 4]) * w`` feeds the region's backward ``mul(grad, relu'(x))``."""
    b = fake_graph()
    x = b.placeholder("x", b.fake(8, 4))
    w = b.placeholder("w", b.fake(4))
    g = b.placeholder("g", b.fake())
    r = b.op(aten.relu.default, x, fqn="layers.0")
    h = b.op(aten.mul.Tensor, r, w, fqn="layers.0")
    e = b.op(aten.expand.default, g, [8, 4])
    gw = b.op(aten.mul.Tensor, e, w)
    mask = b.op(aten.gt.Scalar, x, 0, fqn="layers.0", backward=True)
    gx = b.op(aten.mul.Tensor, gw, mask, fqn="layers.0", backward=True)
    return b.module(h, gx)


def test_a_broadcast_loss_gradient_is_chunked_like_a_creation_op(fake_graph: Any) -> None:
    gm = _scalar_loss_backward(fake_graph)
    x, w, g = torch.randn(8, 4), torch.randn(4), torch.tensor(0.5)
    want = gm(x, w, g)
    report = chunk_pass(gm, CFG)
    assert report.mode == "static" and "mul_tensor_1" in report.split_live_ins
    for got, ref in zip(gm(x, w, g), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_an_expand_of_a_value_with_the_batch_dim_is_not_a_creation(fake_graph: Any) -> None:
    """Only broadcast dims (new or of size 1) of an expand may be chunked: an expand whose
    input already has the extent there stays full, and the pass refuses, untouched."""
    b = fake_graph()
    x = b.placeholder("x", b.fake(8, 4))
    full = b.placeholder("full", b.fake(8, 1))
    e = b.op(aten.expand.default, full, [8, 4])
    gm = b.module(
        b.op(aten.mul.Tensor, b.op(aten.relu.default, x, fqn="layers.0"), e, fqn="layers.0")
    )
    before = snapshot(gm)
    with pytest.raises(Exception, match="shape propagation of the chunk dim first failed"):
        chunk_pass(gm, CFG)
    assert snapshot(gm) == before


def test_tangents_pair_with_the_outputs_they_differentiate(fake_graph: Any) -> None:
    desc = pytest.importorskip("torch._functorch._aot_autograd.descriptors")
    b = fake_graph()
    x = b.placeholder("x", b.fake(8, 4))
    t0 = b.placeholder("tangents_1", b.fake(8, 4))
    t1 = b.placeholder("tangents_2", b.fake(8, 4))
    t0.meta["desc"] = desc.TangentAOTInput(desc.PlainAOTOutput(1))
    t1.meta["desc"] = desc.TangentAOTInput(desc.PlainAOTOutput(0))
    a = b.op(aten.relu.default, x)
    c = b.op(aten.neg.default, x)
    gm = b.module(a, c)
    out = next(iter(gm.graph.find_nodes(op="output")))
    out.meta["desc"] = [desc.PlainAOTOutput(0), desc.PlainAOTOutput(1)]
    assert tangent_outputs(gm.graph) == {t0: c, t1: a}
    out.meta.pop("desc")
    assert tangent_outputs(gm.graph) == {}  # no descriptors: nothing is paired
