"""Two mesh dims (FSDP + TP): ``OverlapBucketingPass`` buckets the FSDP group only.

torch's ``pre_bucket_fsdp_collectives`` identifies the FSDP groups, then buckets every
FSDP-*shaped* all-gather and reduce-scatter of the graph whatever its group: a TP group's
all-gathers of parameter shards were merged too (torchtitan Llama3, FSDP 2 x TP 2 on 4 gloo
ranks: the tp group's backward all-gathers 4 -> 1 and reduce-scatters 10 -> 7,
zoo/RESULTS-meshes.md). The pass now restricts torch's pre-bucketing to the FSDP groups it
found (``primary_fsdp_groups``). The graph (all-gathers of group size 8) is checked
structurally; the numerics on real ranks are the zoo's ``fsdp_tp_2x2`` row
(``tests/test_meshes.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.fx as fx
from ap_bucketing import BucketingConfig, OverlapBucketingPass, primary_fsdp_groups
from ap_testing.collectives import interleaved_fsdp_graph
from ap_testing.distributed import single_rank_gloo
from ap_testing.graphs import fakeify


@pytest.fixture(scope="module")
def groups() -> Iterator[tuple[str, ...]]:
    """(fsdp group, tp group): two distinct groups on one gloo rank."""
    with single_rank_gloo(subgroups=1) as names:
        yield names


def _all_gathers(gm: fx.GraphModule, group: str) -> int:
    return sum(
        1
        for n in gm.graph.nodes
        if n.op == "call_function"
        and str(n.target).startswith("_c10d_functional.all_gather")
        and group in n.args
    )


@pytest.mark.parametrize("reorder", [False, True])
@pytest.mark.parametrize("mode", ["default", "custom_ops"])
def test_only_the_fsdp_group_is_bucketed(groups: tuple[str, ...], mode: str, reorder: bool) -> None:
    fsdp, tp = groups
    # per layer: two FSDP all-gathers and one TP all-gather of parameter shards
    gm = interleaved_fsdp_graph(200, groups=(fsdp, tp, fsdp))
    fakeify(gm)
    assert list(primary_fsdp_groups(gm)[0]) == [fsdp]
    before_fsdp, before_tp = _all_gathers(gm, fsdp), _all_gathers(gm, tp)
    assert before_tp > 1 and before_fsdp == 2 * before_tp

    config = BucketingConfig(max_topo_span=None, bucket_cap_mb=1000.0, bucket_mode=mode)
    OverlapBucketingPass(config, cpu=True, reorder=reorder)(gm.graph)
    gm.graph.lint()
    gm.recompile()

    assert _all_gathers(gm, fsdp) == 1  # the FSDP group: one bucket
    assert _all_gathers(gm, tp) == before_tp  # the TP group: untouched (was merged to 1)
