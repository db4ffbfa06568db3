"""Property-based checks of bucket_collectives on random DAGs of collectives and compute."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from ap_bucketing import BucketingConfig, _reach, bucket_collectives
from ap_bucketing._sizes import collective_bytes
from ap_testing.collectives import GraphBuilder, descendants
from ap_testing.collectives import all_gather_bucketing_args as ag_args
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MIB = 1024 * 1024


@st.composite
def random_dags(draw: st.DrawFn) -> fx.GraphModule:
    """Placeholders, pointwise compute and all-gathers on two groups, with waits issued late
    and out of order, so dependencies and wait order vary freely."""
    b = GraphBuilder(dtype=torch.float32)
    ready: list[fx.Node] = [b.placeholder((draw(st.integers(1, 4)) * 1024,))]
    pending: list[fx.Node] = []
    for _ in range(draw(st.integers(4, 60))):
        action = draw(st.sampled_from(["ph", "compute", "compute", "ag", "ag", "wait"]))
        if action == "ph":
            ready.append(b.placeholder((draw(st.integers(1, 4)) * 1024,)))
        elif action == "compute":
            x = draw(st.sampled_from(ready))
            y = draw(st.sampled_from(ready))
            ready.append(b.add(x, y) if draw(st.booleans()) else b.relu(x))
        elif action == "ag":
            src = draw(st.sampled_from(ready))
            ag = b.all_gather(src, group=draw(st.sampled_from(["dp", "tp"])), group_size=2)[0]
            b.graph.erase_node(next(iter(ag.users)))  # re-issue its wait later
            pending.append(ag)
        elif pending:
            ag = pending.pop(draw(st.integers(0, len(pending) - 1)))
            ready.append(_wait(b, ag))
    while pending:
        ready.append(_wait(b, pending.pop(draw(st.integers(0, len(pending) - 1)))))
    return b.module(ready[-3:])


def _wait(b: GraphBuilder, ag: fx.Node) -> fx.Node:
    w = b.graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (ag,))
    w.meta["val"] = ag.meta["val"]
    return w


def _source(coll: fx.Node) -> fx.Node | None:
    """The placeholder behind ``coll`` through single-input non-collective ops, if any."""
    node = coll
    while len(node.all_input_nodes) == 1:
        node = node.all_input_nodes[0]
        if node.op == "placeholder":
            return node
        if "_c10d_functional" in str(node.target):
            return None
    return None


def _reference(gm: fx.GraphModule, cfg: BucketingConfig, cap: int) -> list[list[str]]:
    """The same greedy rules with full descendant sets (quadratic, obviously correct); with
    ``block_buckets`` a collective gathering a placeholder the bucket already gathers closes it
    (these graphs carry no module FQNs: one segment)."""
    ranks = {n: i for i, n in enumerate(gm.graph.nodes)}
    by_key: dict[Any, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.target is torch.ops._c10d_functional.wait_tensor.default:
            coll = n.args[0]
            by_key.setdefault((coll.args[2], coll.meta["val"].dtype), []).append(coll)
    result: list[list[str]] = []
    for members in by_key.values():
        bucket: list[fx.Node] = []
        desc: set[fx.Node] = set()
        size = 0
        for c in members:
            s = collective_bytes(c)
            assert s is not None
            if bucket:
                rk = [ranks[m] for m in bucket] + [ranks[c]]
                over_span = cfg.max_topo_span is not None and max(rk) - min(rk) > cfg.max_topo_span
                source = _source(c)
                repeat = (
                    cfg.block_buckets
                    and source is not None
                    and source in {_source(m) for m in bucket}
                )
                if size + s > cap or over_span or repeat:
                    if len(bucket) > 1:
                        result.append([m.name for m in bucket])
                    bucket, desc, size = [], set(), 0
                elif c in desc:
                    continue
            bucket.append(c)
            desc |= descendants(c)
            size += s
        if len(bucket) > 1:
            result.append([m.name for m in bucket])
    return result


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
@given(
    gm=random_dags(),
    span=st.one_of(st.none(), st.none(), st.integers(0, 80)),
    cap_mb=st.sampled_from([0.02, 0.1, 100.0, 100.0]),
    blocks=st.booleans(),
)
def test_buckets_respect_all_rules(
    gm: fx.GraphModule, span: int | None, cap_mb: float, blocks: bool
) -> None:
    cfg = BucketingConfig(max_topo_span=span, block_buckets=blocks)
    buckets = bucket_collectives(*ag_args(gm, cap_mb), config=cfg)
    ranks = {n: i for i, n in enumerate(gm.graph.nodes)}
    seen: set[fx.Node] = set()
    for bucket in buckets:
        assert len(bucket) >= 2
        assert not seen & set(bucket), "a collective is in two buckets"
        seen |= set(bucket)
        for member in bucket:  # no ancestor/descendant pair inside a bucket
            assert not descendants(member) & set(bucket)
        assert sum(collective_bytes(m) or 0 for m in bucket) <= int(cap_mb * MIB)
        if span is not None:
            member_ranks = [ranks[m] for m in bucket]
            assert max(member_ranks) - min(member_ranks) <= span
        assert len({(m.args[2], m.meta["val"].dtype) for m in bucket}) == 1
        if blocks:  # never one parameter twice
            sources = [_source(m) for m in bucket if _source(m) is not None]
            assert len(sources) == len(set(sources))
    again = bucket_collectives(*ag_args(gm, cap_mb), config=cfg)
    assert [[m.name for m in bkt] for bkt in again] == [[m.name for m in bkt] for bkt in buckets]
    expected = _reference(gm, cfg, int(cap_mb * MIB))
    assert [[m.name for m in bkt] for bkt in buckets] == expected
    # Same answer when every dependency question goes to the forward sweep.
    quick_limit = _reach._QUICK_LIMIT
    try:
        _reach._QUICK_LIMIT = 0
        swept = bucket_collectives(*ag_args(gm, cap_mb), config=cfg)
    finally:
        _reach._QUICK_LIMIT = quick_limit
    assert [[m.name for m in bkt] for bkt in swept] == expected
