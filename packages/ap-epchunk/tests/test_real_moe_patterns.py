"""The patterns of real MoE code (torchtitan's Qwen3-MoE / DeepSeek-V3) and the graphs that used
to be accepted and crash at run time: each is now chunked correctly (and run) or refused with a
message naming the node where it goes wrong."""

from __future__ import annotations

import operator
import warnings
from typing import Any

import pytest
import torch
from ap_epchunk import ChunkConfig, ChunkError, chunk_pass, concretize_chunk_symbols
from ap_epchunk._rewrite import Rewriter
from ap_testing.graphs import snapshot

aten = torch.ops.aten
CFG = ChunkConfig(module_patterns=("layers.*",))


def _run(gm: torch.fx.GraphModule, *inputs: torch.Tensor) -> Any:
    concretize_chunk_symbols(gm)
    gm.recompile()
    return gm(*inputs)


# ------------------------------------------------------------------ accepted, then crashed
def test_view_with_the_full_extent_baked_in_is_refused(fake_graph: Any) -> None:
    """``view(x, [4, 3])`` on a 4-token input: each chunk has 6 elements, not 12."""
    b = fake_graph()
    u0 = b.unbacked(4)
    x = b.placeholder("x", b.fake(u0, 3))
    h = b.op(aten.relu.default, x, fqn="layers.0")
    v = b.graph.call_function(aten.view.default, (h, [4, 3]))
    v.meta["val"] = h.meta["val"]
    v.meta["custom"] = {"module_fqn": "layers.0"}
    v.meta["stack_trace"] = '  File "moe.py", line 7, in forward\n    x.view(4, 3)\n'
    gm = b.module(v)
    before = snapshot(gm)
    with pytest.raises(ChunkError, match=r"node 'view_default': the constant 4 is baked") as e:
        chunk_pass(gm, CFG)
    assert 'File "moe.py", line 7, in forward: x.view(4, 3)' in str(e.value)
    assert snapshot(gm) == before


@pytest.mark.skipif(
    not hasattr(torch.fx.Graph, "materialize_symints"),
    reason="lifting a divided SymInt into graph nodes needs torch.fx.Graph.materialize_symints, "
    "which this torch lacks (2.11, 2.12): the divided size stays a raw SymInt argument",
)
def test_as_strided_with_a_raw_symint_is_divided_per_chunk(fake_graph: Any) -> None:
    b = fake_graph()
    u0 = b.unbacked(8)
    x = b.placeholder("x", b.fake(u0, 256))
    c = b.op(aten.clone.default, x, fqn="layers.0")
    s = b.op(aten.as_strided.default, c, [u0, 256], [256, 1], fqn="layers.0")
    gm = b.module(b.op(aten.relu.default, s, fqn="layers.0"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = chunk_pass(gm, CFG)
    # torch's own copy of the input graph may warn about the input's raw ``u0``; the divided
    # values the pass made are never raw
    assert not [w for w in caught if "Raw SymInt value ((u0//2))" in str(w.message)]
    # each chunk reads its size from a node computing u0 // 2 out of the graph's own u0
    sizes = [n.args[1][0] for n in gm.graph.nodes if n.target is aten.as_strided.default]
    assert len(sizes) == 2 and sizes[0] is sizes[1]
    assert isinstance(sizes[0], torch.fx.Node) and str(sizes[0].meta["val"]) == "(u0//2)"
    assert sizes[0].target is operator.floordiv and report.lifted_symints == 1
    x_real = torch.randn(8, 256)
    (out,) = _run(gm, x_real)
    torch.testing.assert_close(out, x_real.relu(), rtol=0, atol=0)


def test_as_strided_with_a_storage_offset_is_refused(fake_graph: Any) -> None:
    b = fake_graph()
    u0 = b.unbacked(8)
    x = b.placeholder("x", b.fake(u0, 4))
    c = b.op(aten.clone.default, x, fqn="layers.0")
    s = b.op(aten.as_strided.default, c, [u0, 4], [4, 1], 0, fqn="layers.0")
    gm = b.module(s)
    with pytest.raises(ChunkError, match=r"as_strided with an explicit storage offset"):
        chunk_pass(gm, CFG)


# ------------------------------------------------------------------ refusals that are now chunked
def test_two_hinted_symbols_the_token_dim_picks_one(fake_graph: Any) -> None:
    """An input carrying batch and width symbols: ``ChunkConfig.dim`` names the token dim."""
    for dim, chunked in ((0, "u0"), (1, "u1")):
        b = fake_graph()
        u0, u1 = b.unbacked(8), b.unbacked(6)
        x = b.placeholder("x", b.fake(u0, u1))
        gm = b.module(b.op(aten.relu.default, x, fqn="layers.0"))
        report = chunk_pass(gm, CFG.replace(dim=dim))
        assert list(report.chunk_symbols) == [chunked]


def test_a_data_dependent_scalar_inside_a_region_is_chunked(fake_graph: Any) -> None:
    """``.item()`` in a region: each chunk computes (and binds) its own value."""
    b = fake_graph()
    u0 = b.unbacked(8)
    x = b.placeholder("x", b.fake(u0, 4))
    count = b.op(aten.sum.default, b.op(aten.gt.Scalar, x, 0.0, fqn="layers.0"), fqn="layers.0")
    item = b.op(aten._local_scalar_dense.default, count, fqn="layers.0")
    item.meta["unbacked_bindings"] = {item.meta["val"].node.expr: ()}
    out = b.op(aten.add.Tensor, x, item, fqn="layers.0")
    gm = b.module(out)
    chunk_pass(gm, CFG)
    items = [n for n in gm.graph.nodes if n.target is aten._local_scalar_dense.default]
    assert len(items) == 2
    assert items[0].meta["val"].node.expr != items[1].meta["val"].node.expr
    x_real = torch.randn(8, 4)
    (got,) = _run(gm, x_real)
    want = torch.cat([p + int((p > 0).sum()) for p in x_real.chunk(2)])
    torch.testing.assert_close(got, want)


def test_a_dead_getitem_of_a_multi_output_op_is_not_a_full_user(fake_graph: Any) -> None:
    b = fake_graph()
    u0 = b.unbacked(8)
    x = b.placeholder("x", b.fake(u0, 4))
    mx = b.op(aten.max.dim, x, 1, True, fqn="layers.0")
    values = b.op(operator.getitem, mx, 0, fqn="layers.0")
    b.op(operator.getitem, mx, 1)  # dead, and outside the region (no module FQN)
    gm = b.module(b.op(aten.relu.default, values, fqn="layers.0"))
    chunk_pass(gm, CFG)
    gm.graph.lint()
    x_real = torch.randn(8, 4)
    (got,) = _run(gm, x_real)
    torch.testing.assert_close(got, x_real.max(1, keepdim=True).values.relu())


def test_concretize_removes_the_symbol_of_a_symint_placeholder(fake_graph: Any) -> None:
    b = fake_graph()
    u0 = b.unbacked(8)
    n = b.placeholder("n", u0)
    x = b.placeholder("x", b.fake(u0, 4))
    gm = b.module(b.op(aten.relu.default, x, fqn="layers.0"), n)
    chunk_pass(gm, CFG)
    concretize_chunk_symbols(gm)
    placeholder = next(iter(gm.graph.find_nodes(op="placeholder")))
    assert placeholder.meta["val"] == 8


# ------------------------------------------------------------------ static graphs of real MoE code
def test_zeros_like_scatter_add_combine_is_chunked(fake_graph: Any) -> None:
    """Qwen3-MoE's combine: ``out = zeros_like(x).scatter_add(0, idx, y)`` -- the zeros come
    from a creation op with no chunked input; the probe gives it the chunk size."""
    b = fake_graph()
    x = b.placeholder("x", b.fake(8, 4))
    h = b.op(aten.relu.default, x, fqn="layers.0")
    zeros = b.op(aten.full.default, [8, 4], 0.0, fqn="layers.0")  # zeros_like decomposed
    idx = b.op(aten.zeros_like.default, h, dtype=torch.int64, fqn="layers.0")
    out = b.op(aten.scatter_add.default, zeros, 1, idx, h, fqn="layers.0")
    gm = b.module(b.op(aten.mul.Tensor, out, 2.0, fqn="layers.0"))
    report = chunk_pass(gm, CFG.replace(chunk_inputs=("x",)))
    assert report.regions
    x_real = torch.randn(8, 4)
    want = torch.zeros(8, 4).scatter_add(1, torch.zeros(8, 4, dtype=torch.int64), x_real.relu())
    torch.testing.assert_close(gm(x_real)[0], want * 2)


def test_slice_scatter_of_full_size_zeros_into_index_put_is_chunked(fake_graph: Any) -> None:
    """The backward of ``x_TD[idx].narrow(0, 0, kept)`` (a capacity dispatch keeping ``kept``
    routed rows): ``slice_backward`` starts from full-size zeros and writes rows that do not
    carry the chunk dim (their count is data-dependent), then ``index``'s backward accumulates
    them with chunk-sized indices. The zeros must be chunk-sized too. torch's fake
    ``index_put`` does not check that its values broadcast, so they used to stay full-size and
    shared by the chunks, and the accepted graph failed at run time: ``shape mismatch: value
    tensor of shape [8, 4] cannot be broadcast to indexing result of shape [4, 4]`` (found by
    tests/test_ep_property.py)."""
    b = fake_graph()
    x = b.placeholder("x", b.fake(8, 4))
    w = b.placeholder("w", b.fake(3, 4))  # the kept rows' gradient: no chunk dim
    h = b.op(aten.relu.default, x, fqn="layers.0")
    idx = b.op(
        aten.zeros_like.default,
        b.op(aten.select.int, h, 1, 0, fqn="layers.0"),
        dtype=torch.int64,
        fqn="layers.0",
    )
    zeros = b.op(aten.full.default, [8, 4], 0.0, fqn="layers.0")
    rows = b.op(aten.slice_scatter.default, zeros, w, 0, 0, 3, fqn="layers.0")
    acc = b.op(aten.full.default, [8, 4], 0.0, fqn="layers.0")
    out = b.op(aten.index_put.default, acc, [idx], rows, True, fqn="layers.0")
    gm = b.module(b.op(aten.add.Tensor, out, h, fqn="layers.0"))
    chunk_pass(gm, CFG.replace(chunk_inputs=("x",)))
    x_real, w_real = torch.randn(8, 4), torch.randn(3, 4)
    # each chunk of 4 tokens: its own zeros with w in rows 0..2, all accumulated into row 0
    want = torch.zeros(8, 4)
    want[0] = want[4] = w_real.sum(0)
    torch.testing.assert_close(gm(x_real, w_real)[0], want + x_real.relu())


def test_add_then_copy_into_a_buffer_is_a_mutation_chain(fake_graph: Any) -> None:
    """torchtitan's ``tokens_per_expert.add_(counts)`` arrives functionalized as ``add`` +
    ``copy_``: chunk i adds to chunk i-1's result, the buffer ends up with the full count."""
    b = fake_graph()
    x = b.placeholder("x", b.fake(8, 4))
    buf = b.placeholder("buf", b.fake(4))
    h = b.op(aten.relu.default, x, fqn="layers.0")
    total = b.op(aten.add.Tensor, buf, b.op(aten.sum.dim_IntList, h, [0], fqn="layers.0"))
    total.meta["custom"] = {"module_fqn": "layers.0"}
    b.op(aten.copy_.default, buf, total, fqn="layers.0")
    gm = b.module(h)
    chunk_pass(gm, CFG.replace(chunk_inputs=("x",)))
    adds = [n for n in gm.graph.nodes if n.target is aten.add.Tensor]
    assert [a.name for a in adds] == ["add_tensor_chunk0", "add_tensor_chunk1"]
    assert adds[1].args[0] is adds[0]  # chunk 1 adds to chunk 0's running value
    x_real, buf_real = torch.randn(8, 4), torch.zeros(4)
    gm(x_real, buf_real)
    torch.testing.assert_close(buf_real, x_real.relu().sum(0))


def test_a_refusal_names_the_node_where_propagation_first_failed(fake_graph: Any) -> None:
    """A view outside the chunked regions that would split the chunk dim non-contiguously: the
    refusal names it, with its source line, not the later live-in of ``layers.1``."""
    b = fake_graph()
    x = b.placeholder("x", b.fake(8, 4))
    h = b.op(aten.relu.default, x, fqn="attn")
    t = b.op(aten.t.default, h, fqn="attn")
    ht = b.op(aten.clone.default, t, memory_format=torch.contiguous_format, fqn="attn")
    flat = b.op(aten.view.default, ht, [32], fqn="attn")
    flat.meta["stack_trace"] = '  File "attn.py", line 3, in forward\n    x.t().reshape(-1)\n'
    gm = b.module(b.op(aten.relu.default, flat, fqn="layers.1"))
    before = snapshot(gm)
    with pytest.raises(ChunkError) as e:
        chunk_pass(gm, CFG.replace(chunk_inputs=("x",)))
    msg = str(e.value)
    assert msg.startswith("node 'view_default': shape propagation of the chunk dim first failed")
    assert 'File "attn.py", line 3, in forward: x.t().reshape(-1)' in msg
    assert "region 'layers.1' (forward) cannot tell where its live-in 'view_default'" in msg
    assert snapshot(gm) == before


# ------------------------------------------------------------------ atomicity after planning
def test_a_rewrite_failing_part_way_leaves_the_graph_unchanged(
    fake_graph: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planning succeeds, the rewrite has already changed nodes when it fails: the caller's
    graph is exactly as it was (the pass works on a copy)."""
    b = fake_graph()
    u0 = b.unbacked(8)
    x = b.placeholder("x", b.fake(u0, 4))
    h = b.op(aten.relu.default, x, fqn="layers.0")
    gm = b.module(b.op(aten.neg.default, b.op(aten.tanh.default, h, fqn="layers.0"), fqn="head"))
    before = snapshot(gm)
    calls: list[str] = []
    body_node = Rewriter._body_node

    def failing(self: Rewriter, node: torch.fx.Node, rp: Any) -> None:
        calls.append(node.name)
        body_node(self, node, rp)  # this node is rewritten and its copies inserted
        if len(calls) == 2:
            raise RuntimeError("rewrite failed part-way")

    monkeypatch.setattr(Rewriter, "_body_node", failing)
    with pytest.raises(RuntimeError, match="part-way"):
        chunk_pass(gm, CFG)
    assert calls == ["relu_default", "tanh_default"]
    assert snapshot(gm) == before
    assert "CHUNK" not in str(gm.meta).upper()


# ------------------------------------------------------------------ the token route's mapping
def test_marks_name_the_matching_placeholders(fake_graph: Any) -> None:
    from ap_epchunk import chunk_inputs_from_marks, mark_chunk_dim

    b = fake_graph()
    b.placeholder("primals_1", b.fake(4, 4))
    b.placeholder("primals_2", b.fake(8, 4))
    b.placeholder("primals_3", b.fake(8))
    gm = b.module()
    w, x, y = torch.zeros(4, 4), torch.zeros(8, 4), torch.zeros(8)
    assert chunk_inputs_from_marks(CFG, gm.graph, [w, x, y]) is CFG  # nothing marked
    mark_chunk_dim(x, 0, hint=None)
    mark_chunk_dim(y, 0, hint=None)
    config = chunk_inputs_from_marks(CFG, gm.graph, [w, x, y])
    assert config.chunk_inputs == ("primals_2", "primals_3") and config.dim == 0
    named = CFG.replace(chunk_inputs=("primals_1",))
    assert chunk_inputs_from_marks(named, gm.graph, [w, x, y]) is named  # explicit names win
    z = mark_chunk_dim(torch.zeros(8, 4), 1, hint=None)
    with pytest.raises(ChunkError, match=r"different chunk dims \[0, 1\]"):
        chunk_inputs_from_marks(CFG, gm.graph, [z, x, y])
    with pytest.raises(ChunkError, match=r"node 'primals_3': marked input 2 \(shape \(8, 4\)\)"):
        chunk_inputs_from_marks(CFG, gm.graph, [w, x, z])


def test_marks_follow_the_input_descriptors_past_subclass_placeholders(fake_graph: Any) -> None:
    """A DTensor parameter is one placeholder per inner tensor, so placeholder ``i`` is not
    input ``i``; AOTAutograd's descriptors say which placeholder is flat argument ``i``."""
    from ap_epchunk import chunk_inputs_from_marks, mark_chunk_dim
    from torch._functorch._aot_autograd.descriptors import (
        ParamAOTInput,
        PlainAOTInput,
        SubclassGetAttrAOTInput,
    )

    b = fake_graph()
    param = b.placeholder("primals_1", b.fake(4, 4))
    inner = b.placeholder("primals_2", b.fake(2, 4))  # a DTensor's local tensor
    tokens = b.placeholder("primals_3", b.fake(8, 4))
    gm = b.module()
    param.meta["desc"] = ParamAOTInput("w")
    inner.meta["desc"] = SubclassGetAttrAOTInput(PlainAOTInput(0), "_local_tensor")
    tokens.meta["desc"] = PlainAOTInput(1)
    x = mark_chunk_dim(torch.zeros(8, 4), 0, hint=None)
    config = chunk_inputs_from_marks(CFG, gm.graph, [torch.zeros(2, 4), x])
    assert config.chunk_inputs == ("primals_3",)
    with pytest.raises(ChunkError, match=r"marked input 0 has no placeholder of its own"):
        chunk_inputs_from_marks(CFG, gm.graph, [x, torch.zeros(8, 4)])
