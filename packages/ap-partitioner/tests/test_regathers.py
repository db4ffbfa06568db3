"""``merge_recomputed_gathers``: a recomputation's re-gather of a weight merged with the nearest
backward gather of it; the backward's own repeated gathers left alone.

The activation budget's recomputation re-ran a weight's FSDP gather chain next to the
backward's own re-gather of it (the kit at half the replay's bytes: 30 all-gathers for 21
weights). Chains that differ in input, group or dtype stay apart; the merged graph runs
(one-rank gloo: every collective on real data) to the same values.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives  # noqa: F401  (registers the c10d ops)
import torch.fx as fx
from ap_partitioner._regathers import merge_recomputed_gathers
from ap_testing.distributed import single_rank_gloo

c10d = torch.ops._c10d_functional
aten, prims = torch.ops.aten, torch.ops.prims

#: the names of the gathers the joint graph runs in its backward (the first compilation's)
OWN: set[str] = set()


def _chain(
    g: fx.Graph,
    shard: fx.Node,
    group: str,
    *,
    recomputed: bool = False,
    dtype: torch.dtype = torch.bfloat16,
) -> fx.Node:
    """An FSDP gather chain as extraction copies it: cast, gather, wait, view, transpose; the
    gather of a backward's own chain (not ``recomputed``) is named in ``OWN``."""
    cast = g.call_function(prims.convert_element_type.default, (shard, dtype))
    gathered = g.call_function(c10d.all_gather_into_tensor.default, (cast, 1, group))
    if not recomputed:
        OWN.add(gathered.name)
    waited = g.call_function(c10d.wait_tensor.default, (gathered,))
    viewed = g.call_function(aten.view.default, (waited, [4, 8]))
    return g.call_function(aten.t.default, (viewed,))


def _gathers(g: fx.Graph) -> list[str]:
    return [n.name for n in g.nodes if n.target is c10d.all_gather_into_tensor.default]


def _graph(group: str, other_group: str) -> tuple[fx.GraphModule, list[str]]:
    """Gathers, in order: w1 recomputed (0), w1 the backward's own (1), w2 the backward's own
    (2), w1 recomputed again (3), w1 the backward's own again (4), w1 recomputed over
    ``other_group`` (5), w1 recomputed as float32 (6), w2 recomputed (7)."""
    OWN.clear()
    g = fx.Graph()
    w1, w2, x = g.placeholder("w1"), g.placeholder("w2"), g.placeholder("x")
    x16 = g.call_function(prims.convert_element_type.default, (x, torch.bfloat16))
    outs = []
    for shard, group_name, recomputed, dtype in (
        (w1, group, True, torch.bfloat16),
        (w1, group, False, torch.bfloat16),
        (w2, group, False, torch.bfloat16),
        (w1, group, True, torch.bfloat16),
        (w1, group, False, torch.bfloat16),
        (w1, other_group, True, torch.bfloat16),
        (w1, group, True, torch.float32),
        (w2, group, True, torch.bfloat16),
    ):
        weight = _chain(g, shard, group_name, recomputed=recomputed, dtype=dtype)
        x_in = x16 if dtype is torch.bfloat16 else x
        outs.append(g.call_function(aten.mm.default, (x_in, weight)))
    g.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), g), _gathers(g)


def test_each_recomputed_gather_merges_with_its_nearest_own_gather_and_runs_the_same() -> None:
    with single_rank_gloo(subgroups=1) as (world, other):
        gm, before = _graph(world, other)
        torch.manual_seed(0)
        inputs = (torch.randn(4, 8), torch.randn(4, 8), torch.randn(3, 8))
        want = gm(*inputs)
        removed = merge_recomputed_gathers(gm.graph, OWN)
        gm.graph.lint()
        gm.recompile()
        got = gm(*inputs)
    # 0 -> 1 (kept: the earlier of the pair), 3 -> 4 (nearest own: 3 is closer to 4 than to 1),
    # 7 -> 2 (w2's own); the other group's (5), the float32 one (6) and both of w1's own
    # gathers (1, 4: never merged with each other) stay
    assert removed == [before[1], before[4], before[7]], (before, removed)
    assert _gathers(gm.graph) == [before[0], before[2], before[3], before[5], before[6]]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_without_a_recomputed_gather_the_graph_is_left_exactly_as_it_was() -> None:
    """The backward's own repeated gathers of w1 (0, 3) are the first compilation's choice."""
    OWN.clear()
    g = fx.Graph()
    w1, x = g.placeholder("w1"), g.placeholder("x")
    x16 = g.call_function(prims.convert_element_type.default, (x, torch.bfloat16))
    a = g.call_function(aten.mm.default, (x16, _chain(g, w1, "0")))
    b = g.call_function(aten.mm.default, (x16, _chain(g, w1, "0")))
    g.output((a, b))
    text = str(g)
    assert merge_recomputed_gathers(g, OWN) == []
    assert str(g) == text


def test_the_earlier_of_two_equal_views_serves_both_where_the_kept_gathers_view_comes_late() -> (
    None
):
    """The autograd-order epilogue places a view right before its first reader, so the kept
    (earlier) gather's own view may come after the merged chain's reader: the earlier view is
    kept, and the graph stays in order."""
    with single_rank_gloo() as (world, _):
        OWN.clear()
        g = fx.Graph()
        w1, x = g.placeholder("w1"), g.placeholder("x")
        x16 = g.call_function(prims.convert_element_type.default, (x, torch.bfloat16))
        cast = g.call_function(prims.convert_element_type.default, (w1, torch.bfloat16))
        own = g.call_function(c10d.all_gather_into_tensor.default, (cast, 1, world))
        OWN.add(own.name)
        own_wait = g.call_function(c10d.wait_tensor.default, (own,))
        early = g.call_function(aten.mm.default, (x16, _chain(g, w1, world, recomputed=True)))
        late_view = g.call_function(aten.view.default, (own_wait, [4, 8]))
        late = g.call_function(
            aten.mm.default, (x16, g.call_function(aten.t.default, (late_view,)))
        )
        g.output((early, late))
        gm = fx.GraphModule(torch.nn.Module(), g)
        inputs = (torch.randn(4, 8), torch.randn(3, 8))
        want = gm(*inputs)
        (removed,) = merge_recomputed_gathers(gm.graph, OWN)
        gm.graph.lint()  # every node after what it reads
        gm.recompile()
        got = gm(*inputs)
    assert _gathers(gm.graph) == [own.name] and removed != own.name
    assert all(n is not late_view for n in gm.graph.nodes)  # folded into the early view
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
