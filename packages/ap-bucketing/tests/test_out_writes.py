"""A read of a buffer that an ``out=`` op fills stays after that op, whatever order the
overlap scheduler leaves (torch's ``"custom_ops"`` bucket unpack: ``split_with_sizes_copy.out``
into ``empty`` buffers whose members are read through views with no data edge to the copy)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from ap_bucketing._out_writes import out_write_edges, restore_out_write_order

aten = torch.ops.aten


def _unpack_graph() -> tuple[fx.GraphModule, dict[str, fx.Node]]:
    """``src`` [2, 6] copied into ``empty(12)`` by ``split_with_sizes_copy.out``; the member is
    read as ``view(empty, [3, 4])`` and used by ``relu``: the shape torch's unpack emits."""
    g = fx.Graph()
    src = g.placeholder("src")
    empty = g.call_function(aten.empty.memory_format, ([12],), {"dtype": torch.float32})
    dst = g.call_function(
        aten.view.default, (g.call_function(aten.alias.default, (empty,)), [2, 6])
    )
    copy = g.call_function(aten.split_with_sizes_copy.out, (src, [6], 1), {"out": [dst]})
    member = g.call_function(aten.view.default, (empty, [3, 4]))
    other = g.call_function(aten.neg.default, (src,))
    used = g.call_function(aten.relu.default, (member,))
    g.output((used, other))
    return fx.GraphModule(torch.nn.Module(), g), {
        "copy": copy,
        "member": member,
        "used": used,
        "other": other,
        "dst": dst,
    }


def _names(graph: fx.Graph) -> list[str]:
    return [n.name for n in graph.nodes]


def test_edges_are_the_reads_after_the_write() -> None:
    gm, n = _unpack_graph()
    edges = out_write_edges(gm.graph)
    assert {(w.name, r.name) for w, r in edges} == {
        (n["copy"].name, n["member"].name),
        (n["copy"].name, n["used"].name),
    }


def test_a_read_hoisted_above_the_write_moves_back_and_reads_the_copied_values() -> None:
    gm, n = _unpack_graph()
    edges = out_write_edges(gm.graph)
    # what the overlap scheduler did to the embedding lookup of a gathered weight
    n["copy"].prepend(n["member"])
    n["copy"].prepend(n["used"])
    before = _names(gm.graph)
    assert before.index(n["used"].name) < before.index(n["copy"].name)
    moved = restore_out_write_order(gm.graph, edges)
    after = _names(gm.graph)
    assert moved > 0
    assert after.index(n["copy"].name) < after.index(n["member"].name)
    assert after.index(n["copy"].name) < after.index(n["used"].name)
    # nodes the edges do not constrain keep the scheduler's relative order
    assert after.index(n["other"].name) > after.index(n["dst"].name)
    gm.graph.lint()
    gm.recompile()
    src = torch.randn(2, 6)
    used, other = gm(src)
    torch.testing.assert_close(used, src.reshape(3, 4).relu(), rtol=0, atol=0)
    torch.testing.assert_close(other, -src)


def test_an_order_that_already_holds_is_left_alone() -> None:
    gm, _ = _unpack_graph()
    before = _names(gm.graph)
    assert restore_out_write_order(gm.graph, out_write_edges(gm.graph)) == 0
    assert _names(gm.graph) == before


def test_a_cycle_with_the_data_edges_is_refused_and_the_graph_kept() -> None:
    gm, n = _unpack_graph()
    before = _names(gm.graph)
    # an edge that contradicts the data edges: the copy after something reading its own input
    with pytest.raises(RuntimeError, match=r"cycle .* at node"):
        restore_out_write_order(gm.graph, [(n["used"], n["copy"]), (n["copy"], n["member"])])
    assert _names(gm.graph) == before
