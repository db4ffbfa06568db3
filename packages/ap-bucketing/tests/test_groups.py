"""primary_fsdp_groups: which group is the FSDP group, and its size."""

from __future__ import annotations

import torch.fx as fx
from ap_bucketing import primary_fsdp_groups
from ap_testing.collectives import GraphBuilder


def _ags(groups: list[tuple[str, int]]) -> fx.GraphModule:
    b = GraphBuilder()
    waits = []
    for group, size in groups:
        _, w = b.all_gather(b.placeholder((4, 8)), group=group, group_size=size)
        waits.append(w)
    return b.module(waits)


def test_primary_group_wins_on_imbalanced_counts_with_its_own_size() -> None:
    # tp (size 4) appears first; dp (size 8) has the most FSDP all-gathers.
    gm = _ags([("tp", 4), ("dp", 8), ("dp", 8), ("tp", 4), ("dp", 8), ("dp", 8), ("dp", 8)])
    groups, size = primary_fsdp_groups(gm)
    assert list(groups) == ["dp"]
    assert size == 8  # from the primary group, not from the first all-gather (tp, 4)


def test_tie_picks_exactly_one_group_deterministically() -> None:
    gm = _ags([("tp", 4), ("dp", 8), ("dp", 8), ("tp", 4)])
    first = primary_fsdp_groups(gm)
    assert len(first[0]) == 1
    assert list(first[0]) == ["tp"] and first[1] == 4  # first seen wins
    for _ in range(3):
        assert primary_fsdp_groups(gm) == first


def test_empty_graph_and_non_fsdp_all_gathers() -> None:
    b = GraphBuilder()
    assert primary_fsdp_groups(b.module([])) == (set(), None)
    # An activation all-gather depends on two placeholders: not FSDP.
    b = GraphBuilder()
    x, w = b.placeholder((4, 8)), b.placeholder((4, 8))
    _, wait = b.all_gather(b.add(x, w), group="dp")
    groups, size = primary_fsdp_groups(b.module([wait]))
    assert not groups and size is None


def test_cast_chain_still_counts_as_fsdp() -> None:
    b = GraphBuilder()
    p = b.placeholder((4, 8))
    _, wait = b.all_gather(b.relu(p), group="dp")
    assert primary_fsdp_groups(b.module([wait])) == ({"dp"}, 8)


def test_a_backward_that_only_reduce_scatters_has_a_group() -> None:
    """Gradients reduce-scattered straight to the outputs make an FSDP group even with no
    all-gather in the graph (torch's ``identify_fsdp_groups`` finds none); the group with the
    most of them wins, sized by its own reduce-scatters."""
    b = GraphBuilder()
    waits = []
    for group, size in [("tp", 4), ("dp", 8), ("dp", 8)]:
        _, w = b.reduce_scatter(b.relu(b.placeholder((16, 8))), group=group, group_size=size)
        waits.append(w)
    assert primary_fsdp_groups(b.module(waits)) == ({"dp"}, 8)


def test_a_reduce_scatter_feeding_compute_is_not_fsdp() -> None:
    """A reduce-scatter whose result is added to something (gradient accumulation inside the
    graph, or a sequence-parallel activation) is not an FSDP gradient: torch's bucketing would
    not take it, so it makes no group."""
    b = GraphBuilder()
    x, acc = b.placeholder((16, 8)), b.placeholder((2, 8))
    _, w = b.reduce_scatter(x, group="dp", group_size=8)
    assert primary_fsdp_groups(b.module([b.add(w, acc)])) == (set(), None)


def test_gradient_all_reduces_make_a_group_without_a_size() -> None:
    """DDP: gradients all-reduced straight to the outputs make the group; an all-reduce has no
    ``group_size`` argument, so the size is unknown (torch then uses the configured cap)."""
    b = GraphBuilder()
    waits = [b.all_reduce(b.relu(b.placeholder((16, 8))), group="dp")[1] for _ in range(3)]
    assert primary_fsdp_groups(b.module(waits)) == ({"dp"}, None)
