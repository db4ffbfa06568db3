"""torchtitan#4047: "stable topological sort of region failed" in torch's bucketing.

Torch merges a bucket in place and then reorders the region around the merged collective
(``bucketing._sort_bucket_region``); the reorder fails, with the graph already rewritten, when
one member's input depends on another member's wait: the merged collective would have to run
before and after that input. FSDP+TP+EP graphs (DeepSeek-V3) have such pairs of FSDP-shaped
all-gathers -- both gather something derived from one parameter -- and torchtitan's bucketing
put them in one bucket.

Here: the same shape (a gather of a slice of another gather, between ordinary FSDP gathers)
through ``OverlapBucketingPass`` is bucketed without the dependent member and runs to the same
numbers on a one-rank gloo world; and when torch's merge does hit the failure (the dependency
rule switched off, so torch gets the bucket torchtitan's pass gave it), the pass leaves the
graph exactly as it was and records why in its report.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import ap_bucketing._reach as reach
import pytest
import torch
import torch.fx as fx
from ap_bucketing import BucketingConfig, OverlapBucketingPass, UnsupportedTorchError
from ap_bucketing._compat import predates_fsdp_prebucketing
from ap_testing.collectives import GraphBuilder, aten, c10d
from ap_testing.distributed import single_rank_gloo
from ap_testing.graphs import fakeify, snapshot

AG = c10d.all_gather_into_tensor.default
CONFIG = {"max_topo_span": None, "bucket_cap_mb": 1000.0}


@pytest.fixture(scope="module")
def groups() -> Iterator[tuple[str, ...]]:
    """(FSDP group, TP group) on one gloo rank: collectives run on real data."""
    with single_rank_gloo(subgroups=1) as names:
        yield names


def dependent_gathers_graph(dp: str, tp: str, dim: int = 16) -> fx.GraphModule:
    """Three FSDP-shaped all-gathers on ``dp``; the second gathers a slice of the first's
    result (one placeholder behind it, so torch's ``is_fsdp_all_gather`` holds), plus a TP
    all-reduce of the activation between the matmuls."""
    b = GraphBuilder(dtype=torch.float32)
    x = b.placeholder((dim, dim))
    p1, p2 = b.placeholder((dim, dim)), b.placeholder((dim, dim))
    _, w1 = b.all_gather(p1, group=dp, group_size=1)
    part = b.call(aten.slice.Tensor, (w1, 0, 0, dim), (dim, dim))
    _, w2 = b.all_gather(part, group=dp, group_size=1)
    _, w3 = b.all_gather(p2, group=dp, group_size=1)
    y = b.mm(x, b.call(aten.t.default, (w1,), (dim, dim)))
    _, y = b.all_reduce(y, group=tp)
    y = b.mm(b.relu(y), b.call(aten.t.default, (w2,), (dim, dim)))
    y = b.mm(y, b.call(aten.t.default, (w3,), (dim, dim)))
    gm = b.module([y])
    fakeify(gm)
    return gm


def _inputs(gm: fx.GraphModule) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(n.meta["val"].shape) for n in gm.graph.find_nodes(op="placeholder")]


def _assert_topological(gm: fx.GraphModule) -> None:
    seen: set[fx.Node] = set()
    for node in gm.graph.nodes:
        assert all(i in seen for i in node.all_input_nodes), f"{node.name} before its inputs"
        seen.add(node)


@pytest.mark.parametrize("reorder", [False, True])
@pytest.mark.parametrize("mode", ["default", "custom_ops"])
def test_dependent_gathers_are_bucketed_apart(
    groups: tuple[str, ...], mode: str, reorder: bool
) -> None:
    if mode == "default" and reorder and predates_fsdp_prebucketing():
        pytest.skip("bucket_mode='default' with reordering is refused on this torch (2.11/2.12)")
    dp, tp = groups
    gm = dependent_gathers_graph(dp, tp)
    inputs = _inputs(gm)
    expected = gm(*inputs)
    bucketing_pass = OverlapBucketingPass(
        BucketingConfig(**CONFIG, bucket_mode=mode), cpu=True, reorder=reorder
    )
    bucketing_pass(gm.graph)
    gm.graph.lint()
    _assert_topological(gm)
    gm.recompile()
    report = bucketing_pass.reports[-1]
    assert report["skipped"] is None
    assert report["collectives"]["all_gather"] == (3, 2)  # the dependent gather stays out
    torch.testing.assert_close(gm(*inputs), expected, rtol=0, atol=0)


def test_a_failed_region_sort_leaves_the_graph_unbucketed(
    groups: tuple[str, ...], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With the dependency rule off, torch's merge gets the dependent bucket and raises the
    reported AssertionError; the pass restores the graph and reports the reason."""
    if predates_fsdp_prebucketing():
        pytest.skip("bucket_mode='default' with reordering is refused on this torch (2.11/2.12)")
    dp, tp = groups
    gm = dependent_gathers_graph(dp, tp)
    inputs = _inputs(gm)
    expected = gm(*inputs)
    before = snapshot(gm)
    monkeypatch.setattr(reach.BucketReach, "reaches", lambda self, coll: False)
    bucketing_pass = OverlapBucketingPass(
        BucketingConfig(**CONFIG, bucket_mode="default"), cpu=True, reorder=True
    )
    with caplog.at_level(logging.WARNING, logger="ap_bucketing"):
        bucketing_pass(gm.graph)
    assert snapshot(gm) == before, "a failed bucketing left the graph changed"
    gm.graph.lint()
    gm.recompile()
    report = bucketing_pass.reports[-1]
    skipped = report["skipped"]
    assert isinstance(skipped, str)
    assert "stable topological sort of region failed" in skipped
    assert "a cycle through" in skipped and "left unbucketed" in skipped
    assert report["collectives"]["all_gather"] == (3, 3)
    assert any("torchtitan#4047" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(gm(*inputs), expected, rtol=0, atol=0)


def test_other_assertion_errors_still_propagate(
    groups: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The catch is narrow: only torch's region-sort failure is turned into a report."""
    import ap_bucketing._overlap as overlap

    dp, tp = groups
    gm = dependent_gathers_graph(dp, tp)

    def broken(graph: fx.Graph, edges: object) -> int:
        raise AssertionError("something else")

    monkeypatch.setattr(overlap, "restore_order", broken)
    with pytest.raises(AssertionError, match="something else"):
        OverlapBucketingPass(BucketingConfig(**CONFIG), cpu=True, reorder=False)(gm.graph)


def test_default_mode_reordering_is_refused_only_before_fsdp_prebucketing(
    groups: tuple[str, ...],
) -> None:
    """torch 2.11/2.12 (no Inductor FSDP pre-bucketing): ``bucket_mode="default"`` with
    reordering gave NaN on 2.11 and is refused before the graph changes; newer torch runs it."""
    dp, tp = groups
    gm = dependent_gathers_graph(dp, tp)
    before = snapshot(gm)
    bucketing_pass = OverlapBucketingPass(
        BucketingConfig(**CONFIG, bucket_mode="default"), cpu=True, reorder=True
    )
    if not predates_fsdp_prebucketing():
        bucketing_pass(gm.graph)
        return
    with pytest.raises(UnsupportedTorchError, match="bucket_mode='default' with reordering"):
        bucketing_pass(gm.graph)
    assert snapshot(gm) == before
