"""Graph safety of ap-bucketing over random collective graphs (hypothesis, 200 examples each).

* ``bucket_collectives`` (pure): never mutates the graph; either returns valid buckets
  (>= 2 members, disjoint, one key, no member depending on another, within the byte cap and
  the span) or raises the package's ``MissingValueError`` naming the collective it cannot size.
* The patched greedy function, driven by torch's own ``bucket_all_gather`` /
  ``bucket_reduce_scatter`` under ``patched(config)`` (fake process group, structure only):
  the merged graph lints clean, keeps its outputs, and loses exactly ``sum(len(b) - 1)``
  collectives per bucketed kind; or it raises the package's error and leaves the graph untouched.
  Graphs with collectives are not executed (no numbers on a fake process group).
"""

from __future__ import annotations

import ap_bucketing as AB
import pytest
import torch
import torch._inductor.fx_passes.bucketing as torch_bucketing
import torch.distributed as dist
import torch.fx as fx
from ap_bucketing import BucketingConfig, MissingValueError, bucket_collectives
from ap_bucketing._sizes import collective_bytes
from ap_testing.collectives import RandomCollectiveGraph, descendants, random_collective_graphs
from ap_testing.graphs import snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SAFETY = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
MIB = 1024 * 1024
c10d = torch.ops._c10d_functional
AG, RS = c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default


@pytest.fixture
def groups(fake_pg: str) -> tuple[str, str]:
    """Two fake process groups (structure only: merging resolves group names): the world and
    a subgroup."""
    other = dist.new_group([0, 1])
    return fake_pg, other.group_name  # type: ignore[union-attr]


configs = st.builds(
    BucketingConfig,
    max_topo_span=st.one_of(st.none(), st.integers(0, 40)),
    bucket_cap_mb=st.sampled_from([None, 0.0005, 1.0]),
    non_adjacent=st.booleans(),
)


def test_bucket_collectives_is_pure_and_valid(groups: tuple[str, str]) -> None:
    @SAFETY
    @given(random_collective_graphs(groups), configs)
    def prop(graph: RandomCollectiveGraph, cfg: BucketingConfig) -> None:
        gm = graph.gm
        before = snapshot(gm)
        cap_mb = 0.001
        try:
            buckets = bucket_collectives(
                gm,
                lambda _i: cap_mb,
                torch_bucketing.is_all_gather_into_tensor,
                torch_bucketing._ag_group_key if graph.missing_val is None else (lambda n: "k"),
                config=cfg,
            )
        except MissingValueError as err:
            assert graph.missing_val is not None and graph.missing_val in str(err)
            assert snapshot(gm) == before
            return
        assert snapshot(gm) == before, "bucket_collectives mutated the graph"
        gm.graph.lint()
        ranks = {n: i for i, n in enumerate(gm.graph.nodes)}
        cap = int((cfg.bucket_cap_mb or cap_mb) * MIB)
        seen: set[fx.Node] = set()
        for bucket in buckets:
            assert len(bucket) >= 2 and not seen & set(bucket)
            seen |= set(bucket)
            assert all(m.target is AG for m in bucket)
            for member in bucket:
                assert not descendants(member) & set(bucket)
            assert sum(collective_bytes(m) or 0 for m in bucket) <= cap
            if cfg.max_topo_span is not None:
                rk = [ranks[m] for m in bucket]
                assert max(rk) - min(rk) <= cfg.max_topo_span
            if graph.missing_val is None:  # else every collective shares the key "k"
                assert len({m.args[2] for m in bucket}) == 1

    prop()


def test_patched_greedy_through_the_bucketing_pass_is_safe(groups: tuple[str, str]) -> None:
    """``OverlapBucketingPass(reorder=False)``: torch's FSDP pre-bucketing calling the patched
    group detection and greedy function, then the topological sort the pass owes the graph."""

    @SAFETY
    @given(random_collective_graphs(groups), configs)
    def prop(graph: RandomCollectiveGraph, cfg: BucketingConfig) -> None:
        gm = graph.gm
        before = snapshot(gm)
        outputs_before = [a.name for a in gm.graph.output_node().args[0]]
        fsdp_before = len(AB.primary_fsdp_groups(gm)[0]) if graph.missing_val is None else None
        try:
            AB.OverlapBucketingPass(cfg, reorder=False, cpu=True)(gm.graph)
        except ValueError as err:  # MissingValueError or a key that cannot size a collective
            assert graph.missing_val is not None and graph.missing_val in str(err)
            assert snapshot(gm) == before, "a refusing bucketing pass modified the graph"
            return
        finally:
            assert not AB.is_installed()
        gm.graph.lint()
        gm.recompile()
        assert len(gm.graph.output_node().args[0]) == len(outputs_before)
        if fsdp_before == 0:  # no FSDP group: pre-bucketing must not touch the graph
            assert snapshot(gm) == before
        for node in gm.graph.nodes:  # every wait still waits on a collective
            if node.target is c10d.wait_tensor.default:
                assert isinstance(node.args[0], fx.Node) and node.args[0].op == "call_function"

    prop()


def test_generator_reaches_merging_and_refusals(groups: tuple[str, str]) -> None:
    """The pass property is not vacuous: some graphs get FSDP collectives merged, some are
    refused for a missing value."""
    seen: set[str] = set()

    @settings(
        max_examples=100,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )
    @given(random_collective_graphs(groups))
    def observe(graph: RandomCollectiveGraph) -> None:
        before = snapshot(graph.gm)
        try:
            AB.OverlapBucketingPass(BucketingConfig(), reorder=False, cpu=True)(graph.gm.graph)
        except ValueError:
            seen.add("refused")
            return
        if snapshot(graph.gm) != before:
            seen.add("merged")

    observe()
    assert {"merged", "refused"} <= seen
