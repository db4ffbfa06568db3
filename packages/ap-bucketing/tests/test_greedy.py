"""bucket_collectives: caps, span, dependencies, interleaving, stats, instance config."""

from __future__ import annotations

import logging

import pytest
import torch
import torch._inductor.fx_passes.bucketing as torch_bucketing
import torch.fx as fx
from ap_bucketing import (
    BucketingConfig,
    BucketingStats,
    MissingValueError,
    bucket_collectives,
    collect_stats,
)
from ap_testing.collectives import GraphBuilder
from ap_testing.collectives import all_gather_bucketing_args as ag_args

KIB = 1024
MIB = 1024 * 1024


def _independent_ags(
    n: int, numel: int, group: str = "dp", gap: int = 0
) -> tuple[fx.GraphModule, list[fx.Node]]:
    """``n`` independent placeholder -> all-gather -> wait triples (``group_size=1``: in == out
    bytes), each followed by ``gap`` relus on an unrelated chain."""
    b = GraphBuilder(dtype=torch.float32)
    filler = b.placeholder((4,))
    ags, waits = [], []
    for _ in range(n):
        p = b.placeholder((numel,))
        ag, w = b.all_gather(p, group=group, group_size=1)
        ags.append(ag)
        waits.append(w)
        for _ in range(gap):
            filler = b.relu(filler)
    return b.module([*waits, filler]), ags


def _run(gm: fx.GraphModule, cap_mb: float = 10.0, **cfg: object) -> list[list[fx.Node]]:
    return bucket_collectives(*ag_args(gm, cap_mb), config=BucketingConfig(**cfg))


def test_merge_within_caps() -> None:
    gm, ags = _independent_ags(4, KIB // 4)
    assert _run(gm, max_topo_span=1000) == [ags]


def test_split_on_bytes() -> None:
    gm, ags = _independent_ags(6, 5 * MIB // 4)  # 5 MiB each, cap 10 MiB -> pairs
    buckets = _run(gm, max_topo_span=None)
    assert buckets == [ags[0:2], ags[2:4], ags[4:6]]


def test_split_on_span_while_bytes_are_under_the_cap() -> None:
    gm, ags = _independent_ags(4, 16, gap=50)  # all-gathers 53 ranks apart
    with collect_stats() as stats:
        buckets = _run(gm, max_topo_span=80)
    assert buckets == [ags[0:2], ags[2:4]]
    assert stats[-1].closed_by_span == 1 and stats[-1].closed_by_bytes == 0
    assert stats[-1].max_span <= 80


def test_span_none_disables_the_span_cap() -> None:
    gm, ags = _independent_ags(4, 16, gap=50)
    assert _run(gm, max_topo_span=None) == [ags]


def test_span_zero_is_a_real_cap() -> None:
    gm, _ = _independent_ags(4, 16)
    assert _run(gm, max_topo_span=0) == []


def test_dependent_collectives_never_share_a_bucket() -> None:
    b = GraphBuilder(dtype=torch.float32)
    ag1, w1 = b.all_gather(b.placeholder((16,)), group_size=1)
    ag2, w2 = b.all_gather(b.relu(w1), group_size=1)  # consumes ag1's result
    ag3, w3 = b.all_gather(b.placeholder((16,)), group_size=1)
    with collect_stats() as stats:
        buckets = _run(b.module([w2, w3]))
    assert buckets == [[ag1, ag3]]
    assert all(not (ag1 in bkt and ag2 in bkt) for bkt in buckets)
    assert stats[-1].skipped_dependent == 1


def test_dependency_through_a_long_chain_is_detected() -> None:
    # Longer than the quick backward walk, so the forward sweep has to find it.
    b = GraphBuilder(dtype=torch.float32)
    ag1, w1 = b.all_gather(b.placeholder((16,)), group_size=1)
    x = w1
    for _ in range(40):
        x = b.relu(x)
    ag2, w2 = b.all_gather(x, group_size=1)
    assert _run(b.module([w2])) == []


def _interleaved() -> tuple[fx.GraphModule, list[fx.Node]]:
    b = GraphBuilder()
    ags = []
    waits = []
    for group in ["dp", "tp", "dp", "tp", "dp"]:
        ag, w = b.all_gather(b.placeholder((4, 8)), group=group)
        ags.append(ag)
        waits.append(w)
    return b.module(waits), ags


def test_interleaved_dp_tp_groups_bucket_without_adjacency() -> None:
    gm, ags = _interleaved()
    dp0, tp1, dp2, tp3, dp4 = ags
    assert _run(gm) == [[dp0, dp2, dp4], [tp1, tp3]]
    # torch's adjacency rule forms nothing here; so does non_adjacent=False.
    assert torch_bucketing.greedy_bucket_collective_by_mb(*ag_args(gm)) == []
    assert _run(gm, non_adjacent=False) == []


def test_stats_counts_are_exact_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    # 6 x 4 MiB under a 10 MiB cap (two bytes closes), a tiny one that still fits, one that
    # depends on it (skipped), then two far away (one span close).
    b = GraphBuilder(dtype=torch.float32)
    filler = b.placeholder((4,))
    pairs = [b.all_gather(b.placeholder((MIB,)), group_size=1) for _ in range(6)]
    tiny = b.all_gather(b.placeholder((4,)), group_size=1)
    dep = b.all_gather(b.relu(tiny[1]), group_size=1)
    for _ in range(30):
        filler = b.relu(filler)
    far = [b.all_gather(b.placeholder((4,)), group_size=1) for _ in range(2)]
    gm = b.module([w for _, w in [*pairs, tiny, dep, *far]] + [filler])
    seen: list[BucketingStats] = []
    with caplog.at_level(logging.INFO, logger="ap_bucketing"):
        buckets = bucket_collectives(
            *ag_args(gm),
            config=BucketingConfig(max_topo_span=20),
            observer=seen.append,
        )
    (stats,) = seen
    ags = [ag for ag, _ in pairs]
    assert buckets == [ags[0:2], ags[2:4], [*ags[4:6], tiny[0]], [far[0][0], far[1][0]]]
    assert (stats.candidates, stats.keys, stats.buckets, stats.bucketed) == (10, 1, 4, 9)
    assert (stats.closed_by_bytes, stats.closed_by_span) == (2, 1)
    assert (stats.skipped_dependent, stats.skipped_unhinted) == (1, 0)
    assert stats.max_topo_span == 20
    lines = [r.getMessage() for r in caplog.records if r.name == "ap_bucketing._stats"]
    assert len(lines) == 1 and "4 buckets" in lines[0] and "bytes=2, span=1" in lines[0]


def test_instance_config_is_honoured() -> None:
    gm, ags = _independent_ags(4, 16, gap=50)
    tight, loose = BucketingConfig(max_topo_span=80), BucketingConfig(max_topo_span=10_000)
    assert bucket_collectives(*ag_args(gm), config=tight) == [ags[0:2], ags[2:4]]
    assert bucket_collectives(*ag_args(gm), config=loose) == [ags]
    # bucket_cap_mb on the instance overrides the caller's cap function.
    gm2, ags2 = _independent_ags(4, 256 * KIB)  # 1 MiB each
    capped = BucketingConfig(bucket_cap_mb=2.0)
    assert bucket_collectives(*ag_args(gm2, 100.0), config=capped) == [ags2[0:2], ags2[2:4]]


def _unbacked_graph(hint: int | None) -> tuple[fx.GraphModule, list[fx.Node]]:
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    u = env.create_unbacked_symint()
    if hint is not None:
        env.var_to_hint_override[u.node.expr] = hint
    b = GraphBuilder(dtype=torch.float32)
    ags, waits = [], []
    for _ in range(2):
        p = b.graph.placeholder(f"x{len(ags)}")
        p.meta["val"] = torch.empty((u, 16), device="meta")
        ag = b.graph.call_function(
            torch.ops._c10d_functional.all_gather_into_tensor.default, (p, 8, "dp")
        )
        ag.meta["val"] = torch.empty((u * 8, 16), device="meta")
        w = b.graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (ag,))
        ags.append(ag)
        waits.append(w)
    return b.module(waits), ags


def test_unbacked_size_with_a_hint_buckets() -> None:
    gm, ags = _unbacked_graph(hint=64)
    assert _run(gm) == [ags]


def test_unbacked_size_without_a_hint_is_left_unbucketed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gm, ags = _unbacked_graph(hint=None)
    with collect_stats() as stats, caplog.at_level(logging.WARNING, logger="ap_bucketing"):
        assert _run(gm) == []
    assert stats[-1].skipped_unhinted == 2
    assert ags[0].name in caplog.text


def test_missing_meta_val_names_the_node() -> None:
    gm, ags = _independent_ags(2, 16)
    del ags[1].all_input_nodes[0].meta["val"]
    with pytest.raises(MissingValueError, match=ags[1].name):
        _run(gm)
    # A key function that cannot read the node fails with the node's name, not a KeyError.
    del ags[1].meta["val"]
    with pytest.raises(ValueError, match=ags[1].name):
        _run(gm)


def test_bad_config_values_name_the_field() -> None:
    for field, value, exc in [
        ("max_topo_span", -1, ValueError),
        ("max_topo_span", True, TypeError),
        ("max_compute_pre_fetch", 1.5, TypeError),
        ("bucket_cap_mb", 0, ValueError),
        ("bucket_cap_mb", float("nan"), ValueError),
        ("primary_group_only", 1, TypeError),
        ("non_adjacent", "yes", TypeError),
    ]:
        with pytest.raises(exc, match=f"BucketingConfig: {field} must be"):
            BucketingConfig(**{field: value})
    with pytest.raises(TypeError, match="bucket_collectives: config must be a BucketingConfig"):
        bucket_collectives(*_independent_ags(2, 16)[:1], lambda _i: 1.0, bool, id, config=object())


def test_wrong_argument_kinds_name_the_function_and_argument() -> None:
    gm, _ = _independent_ags(2, 16)
    _, cap, filt, key = ag_args(gm)
    with pytest.raises(TypeError, match="bucket_collectives: gm must be a torch.fx.GraphModule"):
        bucket_collectives(gm.graph, cap, filt, key)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bucket_collectives: group_key must be callable"):
        bucket_collectives(gm, cap, filt, "key")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"cap_fn's result for bucket 0 must be .*, got float -1\.0"
    ):
        bucket_collectives(gm, lambda _i: -1.0, filt, key)
