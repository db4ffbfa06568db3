"""Regressions: a backward suffix replayed once through a view whose size is a symbolic scalar
(early accumulation), and a symbolic scalar live-out that must stay a Python int."""

from __future__ import annotations

import operator
from typing import Any

import torch
from ap_epchunk import ChunkConfig, chunk_pass, concretize_chunk_symbols

aten = torch.ops.aten


def test_backward_suffix_with_symbolic_view_under_early_accumulation_lints_clean(
    fake_graph: Any,
) -> None:
    # mm(grad_out[u0, 3], w) -> view([3 * u0]) -> full user; the view's shape is a scalar
    # computed outside the region from the chunk symbol.
    b = fake_graph()
    u0 = b.unbacked(8)
    w = b.placeholder("w", b.fake(3, 3))
    g = b.placeholder("grad_out", b.fake(u0, 3))
    size = b.op(aten.sym_size.int, g, 0, backward=True)
    numel = b.op(operator.mul, size, 3, backward=True)
    mm = b.op(aten.mm.default, g, w, fqn="layers.0", backward=True)
    flat = b.op(aten.view.default, mm, [numel], fqn="layers.0", backward=True)
    flat_name = flat.name
    gm = b.module(flat)
    w_real, g_real = torch.randn(3, 3), torch.randn(8, 3)
    want = gm(w_real, g_real)[0]

    chunk_pass(gm, ChunkConfig(module_patterns=("layers.*",), early_grad_accumulation=True))
    gm.graph.lint()
    out = next(iter(gm.graph.find_nodes(op="output"))).args[0][0]
    # cat first, then the view replayed once on the full value with the full-size scalar
    assert out.name == f"{flat_name}_full" and out.target is aten.view.default
    assert [a.name for a in out.args[1]] == [numel.name]  # the full-size scalar
    assert out.args[0].target is aten.cat.default
    assert torch.equal(gm(w_real, g_real)[0], want)
    concretize_chunk_symbols(gm)
    assert torch.equal(gm(w_real, g_real)[0], want)


def test_symbolic_scalar_live_out_stays_an_int(fake_graph: Any) -> None:
    b = fake_graph()
    u0 = b.unbacked(8)
    x = b.placeholder("x", b.fake(u0, 3))
    size = b.op(aten.sym_size.int, x, 0, fqn="layers.0")
    y = b.op(aten.relu.default, x, fqn="layers.0")
    gm = b.module(size, y)
    chunk_pass(gm, ChunkConfig(module_patterns=("layers.*",)))
    full = next(iter(gm.graph.find_nodes(op="output"))).args[0][0]
    assert full.target is operator.add  # not aten.add.Tensor, which returns a tensor
    assert str(full.meta["val"]) == "u0"
    size_out, y_out = gm(torch.randn(8, 3))
    assert type(size_out) is int and size_out == 8
    assert y_out.shape == (8, 3)
    concretize_chunk_symbols(gm)
    size_out, _ = gm(torch.randn(8, 3))
    assert type(size_out) is int and size_out == 8
