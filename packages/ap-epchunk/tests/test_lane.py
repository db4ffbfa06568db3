"""``exchange_lane``: chunked token exchanges that share a process group with another collective
move to a group of their own with the same ranks; values unchanged (a one-rank gloo world, where
every collective runs on real data)."""

from __future__ import annotations

from typing import Any

import torch
from ap_epchunk import LaneReport, exchange_lane
from ap_testing.distributed import single_rank_gloo

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _graph(group: str, *, fsdp_group: str | None) -> torch.fx.GraphModule:
    """Two chunks of ``relu -> exchange -> wait``, tagged as ``chunk_pass`` tags them, and (with
    ``fsdp_group``) an all-gather of a weight on that group."""
    g = torch.fx.Graph()
    xs = [g.placeholder(f"x{i}") for i in range(2)]
    w = g.placeholder("w")
    outs = []
    for i in range(2):
        r = g.call_function(aten.relu.default, (xs[i],))
        a = g.call_function(c10d.all_to_all_single.default, (r, [4], [4], group))
        done = g.call_function(c10d.wait_tensor.default, (a,))
        for node in (r, a, done):
            node.meta["custom"] = {"ap_chunk_region": "moe", "ap_chunk_index": i}
        outs.append(done)
    if fsdp_group is not None:
        ag = g.call_function(c10d.all_gather_into_tensor.default, (w, 1, fsdp_group))
        outs.append(g.call_function(c10d.wait_tensor.default, (ag,)))
    g.output(tuple(outs))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _groups(gm: torch.fx.GraphModule) -> list[Any]:
    return [n.args[-1] for n in gm.graph.nodes if n.target is c10d.all_to_all_single.default]


def test_shared_group_moves_to_a_lane_and_values_stay() -> None:
    args = [torch.randn(4, 3), torch.randn(4, 3), torch.randn(2, 3)]
    with single_rank_gloo(subgroups=0) as (world,):
        gm = _graph(world, fsdp_group=world)
        before = gm(*args)
        report = exchange_lane(gm)
        assert report.exchanges_moved == 2 and report.reason is None
        lane = report.lanes[world]
        assert lane != world and _groups(gm) == [lane, lane]
        after = gm(*args)
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        # one lane per group and process: a second graph reuses it
        again = _graph(world, fsdp_group=world)
        assert exchange_lane(again).lanes == {world: lane}


def test_nothing_moves_without_a_shared_group() -> None:
    with single_rank_gloo(subgroups=1) as (world, other):
        gm = _graph(world, fsdp_group=other)
        report = exchange_lane(gm)
        assert report == LaneReport(reason=report.reason) and report.reason is not None
        assert "shares a process group" in report.reason
        assert _groups(gm) == [world, world]
        assert exchange_lane(_graph(world, fsdp_group=None)).exchanges_moved == 0
