"""The in-place write order of a graph survives bucketing and overlap scheduling.

Two shapes: a read of a buffer that an ``out=`` op fills (torch's ``"custom_ops"`` bucket
unpack: ``split_with_sizes_copy.out`` into ``empty`` buffers whose members are read through
views with no data edge to the copy), and a joint graph traced without functionalization, as
torchtitan's graph_trainer traces its train step: gradients written with ``copy_`` into slices
of a buffer the backward then reads whole, and ``add_`` accumulation (all-zero gradients when
the scheduler hoisted the reads above the writes)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from ap_bucketing import BucketingConfig, OverlapBucketingPass
from ap_bucketing._hazards import HazardCycle, hazard_edges, restore_order, written_storages
from ap_testing.distributed import chunked_head_step, single_rank_gloo
from torch.fx.experimental.proxy_tensor import make_fx

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
    """Taking a view is not a read (only the view's readers are), so the one pair is the
    copy before ``relu``."""
    gm, n = _unpack_graph()
    edges = hazard_edges(gm.graph)
    assert {(w.name, r.name) for w, r in edges} == {(n["copy"].name, n["used"].name)}


def test_a_read_hoisted_above_the_write_moves_back_and_reads_the_copied_values() -> None:
    gm, n = _unpack_graph()
    edges = hazard_edges(gm.graph)
    # what the overlap scheduler did to the embedding lookup of a gathered weight
    n["copy"].prepend(n["member"])
    n["copy"].prepend(n["used"])
    before = _names(gm.graph)
    assert before.index(n["used"].name) < before.index(n["copy"].name)
    moved = restore_order(gm.graph, edges)
    after = _names(gm.graph)
    assert moved > 0
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
    assert restore_order(gm.graph, hazard_edges(gm.graph)) == 0
    assert _names(gm.graph) == before


def test_a_cycle_with_the_data_edges_is_refused_and_the_graph_kept() -> None:
    gm, n = _unpack_graph()
    before = _names(gm.graph)
    # an edge that contradicts the data edges: the copy after something reading its own input
    with pytest.raises(HazardCycle, match=r"cycle .* at node"):
        restore_order(gm.graph, [(n["used"], n["copy"]), (n["copy"], n["member"])])
    assert _names(gm.graph) == before


def _in_place_graph() -> tuple[fx.GraphModule, dict[str, fx.Node]]:
    """``buf = zeros; r0 = buf.sum(); buf[0:2].copy_(x); buf.add_(1); r1 = buf * 2``: a read
    before the writes, two writes (one through a slice view), a read after them."""
    g = fx.Graph()
    x = g.placeholder("x")
    buf = g.call_function(aten.zeros.default, ([4, 3],))
    r0 = g.call_function(aten.sum.default, (buf,))
    part = g.call_function(aten.slice.Tensor, (buf, 0, 0, 2))
    copy = g.call_function(aten.copy_.default, (part, x))
    add = g.call_function(aten.add_.Scalar, (buf, 1.0))
    r1 = g.call_function(aten.mul.Tensor, (buf, 2.0))
    g.output((r0, r1))
    return fx.GraphModule(torch.nn.Module(), g), {
        "buf": buf,
        "r0": r0,
        "copy": copy,
        "add": add,
        "r1": r1,
        "x": x,
    }


def test_in_place_writes_through_views_order_every_access_of_the_storage() -> None:
    gm, n = _in_place_graph()
    assert written_storages(gm.graph) == {n["buf"]}
    pairs = {(a.name, b.name) for a, b in hazard_edges(gm.graph)}
    assert pairs == {
        (n["r0"].name, n["copy"].name),  # write after read
        (n["copy"].name, n["add"].name),  # write after write
        (n["add"].name, n["r1"].name),  # read after write
    }


def test_reordered_in_place_accesses_move_back_and_compute_the_original_values() -> None:
    gm, n = _in_place_graph()
    edges = hazard_edges(gm.graph)
    x = torch.randn(2, 3)
    expected = gm(x)
    # what a data-edge-only scheduler may do: the later read first, the early read last
    n["copy"].prepend(n["r1"])
    n["add"].append(n["r0"])
    gm.recompile()
    assert not all(torch.equal(a, b) for a, b in zip(gm(x), expected, strict=True))
    assert restore_order(gm.graph, edges) > 0
    gm.graph.lint()
    gm.recompile()
    for got, want in zip(gm(x), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_non_functional_joint_graph_trains_the_same_after_the_pass() -> None:
    """The pass buckets and schedules a traced step with in-place writes and the gradients stay
    exact (without the write order restored they were off by 2.5e4 here: the trunk's
    backward read the hidden-state gradient buffer before the chunks were copied into it);
    the reduce-scatter of the ``add_``-accumulated head gradient stays out of the buckets."""
    with single_rank_gloo(subgroups=0):
        torch.manual_seed(0)
        x = torch.randn(32, 16)
        shards = [torch.randn(16, 16, requires_grad=True) for _ in range(5)]
        gm = make_fx(chunked_head_step, tracing_mode="fake")(x, *shards)
        assert sum(n.target is aten.copy_.default for n in gm.graph.nodes) == 2
        with torch.no_grad():
            expected = gm(x, *shards)
        bucketing = OverlapBucketingPass(
            BucketingConfig(max_topo_span=None, bucket_cap_mb=1000.0), cpu=True
        )
        bucketing(gm.graph)
        gm.recompile()
        with torch.no_grad():
            got = gm(x, *shards)
    report = bucketing.reports[-1]
    assert report["skipped"] is None
    assert report["collectives"]["all_gather"] == (5, 1)
    assert report["collectives"]["reduce_scatter"] == (5, 2)
    assert report["unbucketed_reading_written_storage"] == ["reduce_scatter_tensor"]
    assert isinstance(report["hazard_reorders"], int) and report["hazard_reorders"] > 0
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_a_write_order_no_schedule_can_keep_leaves_the_graph_as_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``HazardCycle`` after scheduling: the pass restores the graph it was given (collectives
    and order) and records why; it never hands on a graph that reads before a write."""
    import ap_bucketing._overlap as overlap

    def cyclic(graph: fx.Graph, edges: object) -> int:
        raise HazardCycle("the in-place write order ... forms a cycle (test)")

    monkeypatch.setattr(overlap, "restore_order", cyclic)
    with single_rank_gloo(subgroups=0):
        x = torch.randn(32, 16)
        shards = [torch.randn(16, 16, requires_grad=True) for _ in range(5)]
        gm = make_fx(chunked_head_step, tracing_mode="fake")(x, *shards)
        before = [(n.name, n.format_node()) for n in gm.graph.nodes]
        bucketing = OverlapBucketingPass(BucketingConfig(), cpu=True)
        bucketing(gm.graph)
    assert [(n.name, n.format_node()) for n in gm.graph.nodes] == before
    skipped = bucketing.reports[-1]["skipped"]
    assert isinstance(skipped, str) and "cycle" in skipped and "left unbucketed" in skipped
