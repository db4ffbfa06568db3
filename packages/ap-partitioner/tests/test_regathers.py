"""``merge_repeated_gathers``: a backward that gathers one weight twice gathers it once.

The activation budget's recomputation re-ran a weight's FSDP gather chain next to the
backward's own re-gather of it (the kit at half the replay's bytes: 30 all-gathers for 21
weights). Chains that differ in input, group, dtype or any op stay apart; the merged graph runs
(one-rank gloo: every collective on real data) to the same values.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives  # noqa: F401  (registers the c10d ops)
import torch.fx as fx
from ap_partitioner._regathers import merge_repeated_gathers
from ap_testing.distributed import single_rank_gloo

c10d = torch.ops._c10d_functional
aten, prims = torch.ops.aten, torch.ops.prims


def _chain(g: fx.Graph, shard: fx.Node, group: str, dtype: torch.dtype = torch.bfloat16) -> fx.Node:
    """An FSDP gather chain as extraction copies it: cast, gather, wait, view, transpose."""
    cast = g.call_function(prims.convert_element_type.default, (shard, dtype))
    gathered = g.call_function(c10d.all_gather_into_tensor.default, (cast, 1, group))
    waited = g.call_function(c10d.wait_tensor.default, (gathered,))
    viewed = g.call_function(aten.view.default, (waited, [4, 8]))
    return g.call_function(aten.t.default, (viewed,))


def _gathers(g: fx.Graph) -> list[str]:
    return [n.name for n in g.nodes if n.target is c10d.all_gather_into_tensor.default]


def _graph(group: str, second_group: str | None = None) -> tuple[fx.GraphModule, list[str]]:
    """``w1`` gathered three times (a recompute's twice, the backward's once), ``w2`` once,
    ``w1`` once more over ``second_group`` and once as float32: what survives a merge is one
    gather of ``w1`` in bf16 over ``group``, plus the three that differ."""
    g = fx.Graph()
    w1, w2, x = g.placeholder("w1"), g.placeholder("w2"), g.placeholder("x")
    x16 = g.call_function(prims.convert_element_type.default, (x, torch.bfloat16))
    first = _chain(g, w1, group)
    y = g.call_function(aten.mm.default, (x16, first))
    other = _chain(g, w2, group)
    z = g.call_function(aten.mm.default, (x16, other))
    again = _chain(g, w1, group)
    u = g.call_function(aten.mm.default, (x16, again))
    once_more = _chain(g, w1, group)
    v = g.call_function(aten.add.Tensor, (u, g.call_function(aten.mm.default, (x16, once_more))))
    elsewhere = _chain(g, w1, second_group or group)
    wide = _chain(g, w1, group, torch.float32)
    s = g.call_function(aten.sum.default, (elsewhere,))
    t = g.call_function(aten.sum.default, (wide,))
    g.output((y, z, v, s, t))
    gm = fx.GraphModule(torch.nn.Module(), g)
    return gm, _gathers(g)


def test_a_repeated_gather_chain_is_merged_into_the_first_and_the_graph_runs_the_same() -> None:
    with single_rank_gloo(subgroups=1) as (world, other):
        gm, before = _graph(world, other)
        torch.manual_seed(0)
        inputs = (torch.randn(4, 8), torch.randn(4, 8), torch.randn(3, 8))
        want = gm(*inputs)
        removed = merge_repeated_gathers(gm.graph)
        gm.graph.lint()
        gm.recompile()
        got = gm(*inputs)
    # w1's second and third bf16 gathers over the same group go; the other group's, the
    # float32 one and w2's stay
    assert removed == [before[2], before[3]], (before, removed)
    assert _gathers(gm.graph) == [before[0], before[1], before[4], before[5]]
    casts = [n for n in gm.graph.nodes if n.target is prims.convert_element_type.default]
    assert len(casts) == 5  # x's, and one per gather left: the removed chains' casts are gone
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_graph_without_repeats_is_left_exactly_as_it_was() -> None:
    gm, before = _graph("0", "1")
    # drop the repeats by hand: w1 once per group and dtype, w2 once
    for i, name in enumerate((before[2], before[3])):
        node = next(n for n in gm.graph.nodes if n.name == name)
        node.args = (node.args[0], 1, f"group{i}")
    text = str(gm.graph)
    assert merge_repeated_gathers(gm.graph) == []
    assert str(gm.graph) == text
