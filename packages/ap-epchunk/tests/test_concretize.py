"""concretize_chunk_symbols: args, vals, HOP subgraphs, guards, and nothing else touched."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
from ap_epchunk import ChunkError, concretize_chunk_symbols
from ap_epchunk._passes import CHUNK_SYMBOLS_META
from ap_testing.graphs import snapshot

aten = torch.ops.aten


def _apply_subgraph(sub: torch.fx.GraphModule, x: torch.Tensor) -> Any:
    return sub(x)


def _graph_with_other_symbol(fake_graph: Any) -> tuple[Any, torch.fx.GraphModule]:
    b = fake_graph()
    u0, u1 = b.unbacked(8), b.unbacked(None)  # u1: not a chunk symbol
    x = b.placeholder("x", b.fake(u0, 4))
    other = b.placeholder("other", b.fake(u1, 4))
    size = b.op(aten.sym_size.int, x, 0)
    half = b.op(operator.floordiv, size, 2)
    split = b.op(aten.split_with_sizes.default, x, [half, half], 0)
    first = b.op(operator.getitem, split, 0)
    other_size = b.op(aten.sym_size.int, other, 0)
    mixed = b.op(operator.add, size, other_size)
    flat = b.op(aten.view.default, other, [-1])
    gm = b.module(first, mixed, flat)
    gm.meta[CHUNK_SYMBOLS_META] = {"u0": 8}
    return b, gm


def test_symbols_in_args_and_vals_are_replaced_and_scalars_folded(fake_graph: Any) -> None:
    _, gm = _graph_with_other_symbol(fake_graph)
    report = concretize_chunk_symbols(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    split = nodes["split_with_sizes_default"]
    assert split.args[1] == [4, 4]  # folded from floordiv(sym_size(x, 0), 2)
    assert "floordiv" not in nodes  # dead scalar plumbing erased
    assert nodes["getitem"].meta["val"].shape == (4, 4)
    assert nodes["x"].meta["val"].shape == (8, 4)
    assert report.symbols == {"u0": 8} and report.folded >= 2
    assert CHUNK_SYMBOLS_META not in gm.meta
    first, mixed, flat = gm(torch.randn(8, 4), torch.randn(3, 4))
    assert first.shape == (4, 4) and mixed == 11 and flat.shape == (12,)


def test_other_symbols_are_not_touched(fake_graph: Any) -> None:
    _, gm = _graph_with_other_symbol(fake_graph)
    concretize_chunk_symbols(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    assert str(nodes["other"].meta["val"].shape[0]) == "u1"
    assert str(nodes["view_default"].meta["val"].shape[0]) == "4*u1"
    assert str(nodes["add"].meta["val"]) == "u1 + 8"  # u0 + u1, only u0 substituted
    assert nodes["sym_size_int_1"].args == (nodes["other"], 0)  # u1's plumbing stays


def test_hop_subgraph_placeholders_and_vals(fake_graph: Any) -> None:
    b = fake_graph()
    u0 = b.unbacked(8)
    sub_b = fake_graph()
    sub_b.shape_env, sub_b.fake_mode = b.shape_env, b.fake_mode
    inner_x = sub_b.placeholder("inner_x", b.fake(u0, 4))
    inner_x.meta["example_value"] = b.fake(u0, 4)
    inner_n = sub_b.op(aten.sym_size.int, inner_x, 0)
    inner_n.meta["example_value"] = inner_n.meta["val"]
    sub = sub_b.module(sub_b.op(aten.relu.default, inner_x))
    x = b.placeholder("x", b.fake(u0, 4))
    b.graph.owning_module = None
    root = torch.nn.Module()
    root.sub = sub  # type: ignore[assignment]
    getter = b.graph.get_attr("sub")
    call = b.graph.call_function(_apply_subgraph, (getter, x))
    call.meta["val"] = b.fake(u0, 4)
    b.graph.output((call,))
    gm = torch.fx.GraphModule(root, b.graph)
    gm.meta[CHUNK_SYMBOLS_META] = {"u0": 8}
    report = concretize_chunk_symbols(gm)
    assert report.graphs == 2
    sub_nodes = {n.name: n for n in gm.sub.graph.nodes}  # type: ignore[union-attr]
    assert sub_nodes["inner_x"].meta["example_value"].shape == (8, 4)
    assert sub_nodes["inner_x"].meta["val"].shape == (8, 4)
    assert "sym_size_int" not in sub_nodes  # folded and erased inside the subgraph too
    assert gm(torch.randn(8, 4))[0][0].shape == (8, 4)


@pytest.mark.parametrize(("expected", "holds"), [(6, False), (8, True)])
def test_guards_false_raise_true_are_erased(expected: int, holds: bool, fake_graph: Any) -> None:
    b = fake_graph()
    u0 = b.unbacked(8)
    x = b.placeholder("x", b.fake(u0, 4))
    size = b.op(aten.sym_size.int, x, 0)
    cond = b.op(operator.eq, size, expected)
    guard = b.graph.call_function(aten._assert_scalar.default, (cond, "x must have 6 rows"))
    guard.meta["val"] = None
    gm = b.module(b.op(aten.relu.default, x))
    gm.meta[CHUNK_SYMBOLS_META] = {"u0": 8}
    before = snapshot(gm)
    if not holds:
        with pytest.raises(ChunkError, match="guard is false.*x must have 6 rows"):
            concretize_chunk_symbols(gm)
        assert snapshot(gm) == before
        assert gm.meta[CHUNK_SYMBOLS_META] == {"u0": 8}
    else:
        concretize_chunk_symbols(gm)
        targets = {n.target for n in gm.graph.nodes}
        assert aten._assert_scalar.default not in targets and operator.eq not in targets


def test_example_inputs_list_is_updated_in_place(fake_graph: Any) -> None:
    b, gm = _graph_with_other_symbol(fake_graph)
    inputs: list[Any] = [b.fake(b.unbacked(8), 4), 3]
    inputs[0] = next(iter(gm.graph.find_nodes(op="placeholder"))).meta["val"]
    concretize_chunk_symbols(gm, inputs)
    assert inputs[0].shape == (8, 4) and inputs[1] == 3


def test_without_chunk_symbols_it_is_a_no_op(fake_graph: Any) -> None:
    b = fake_graph()
    x = b.placeholder("x", b.fake(b.unbacked(None), 4))
    gm = b.module(b.op(aten.relu.default, x))
    before = snapshot(gm)
    assert concretize_chunk_symbols(gm).symbols == {}
    assert snapshot(gm) == before


def test_a_scalar_placeholder_is_folded_into_its_users_and_kept(fake_graph: Any) -> None:
    """Dynamo passes a symbolic token extent as a graph input of its own. Concretized, the
    placeholder stays (the graph's signature is the caller's) but nothing reads it: a
    partitioner would otherwise save a plain int for the backward, which AOTAutograd counts
    neither as a tensor nor as a SymInt ("expected one saved_tensor_is_graph_input entry per
    saved tensor")."""
    b = fake_graph()
    u0 = b.unbacked(8)
    n = b.placeholder("n", u0)
    x = b.placeholder("x", b.fake(u0, 4))
    twice = b.op(operator.mul, n, 2)
    flat = b.op(aten.view.default, x, [twice, 2])
    ones = b.op(aten.ones.default, [n, 2])  # a size argument reading the placeholder itself
    gm = b.module(flat, twice, ones)
    gm.meta[CHUNK_SYMBOLS_META] = {"u0": 8}
    concretize_chunk_symbols(gm)
    nodes = {node.name: node for node in gm.graph.nodes}
    assert nodes["n"].op == "placeholder" and nodes["n"].meta["val"] == 8
    assert not nodes["n"].users
    assert nodes["view_default"].args[1] == [16, 2]
    assert nodes["ones_default"].args[0] == [8, 2]
    out, doubled, ones = gm(8, torch.randn(8, 4))
    assert out.shape == (16, 2) and doubled == 16 and ones.shape == (8, 2)
