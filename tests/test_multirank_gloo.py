"""2 gloo ranks, 4 SGD steps: the two-stage compile (precompile + autoparallel_backend) matches
eager per step -- loss and every parameter's (sharded) grad at rtol 1e-5 fp32 -- with AC off,
ap-bucketing with overlap scheduling in both of torch's bucket forms, each named explicitly
(``"custom_ops"``, the default, gave NaN losses until ap-bucketing kept the overlap scheduler
from hoisting reads of a bucket's members above the ``out=`` copy that fills them), and the
full configuration on ap's own FSDP schedule (``overlap_scheduling="prefetch"``: AC and
copy-free coalesced buckets). One spawn runs all four configurations.

AC with the default bucketing and no overlap scheduler (``enable_ac=True`` alone) was a fifth
variant here until 2026-12-04, when the suite ran over CI's 30 minutes (about 28 s of it). AC
at 2 ranks is still checked against eager by ``full_prefetch`` here and by the full
configuration on torchtitan's Llama3 (``zoo.meshes``' ``accum_eval`` row,
``tests/test_meshes.py``); ``enable_ac=True`` alone at 1 rank by
``packages/ap-backend/tests/test_gpu.py`` (``world1_numerics_match_eager[cpu-ac]``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from ap_backend.demo import (
    DemoOptions,
    TrainSpec,
    Variant,
    build_spec,
    expert_parallel_summary,
    run_rank,
    spawn_ranks,
)
from ap_backend.models import ModelConfig
from ap_bucketing import BucketingConfig

VARIANTS = (
    Variant("ac_off", {"enable_ac": False}),
    Variant("bucketing_overlap", {"bucketing": True, "overlap_scheduling": True}),
    Variant(
        "bucketing_overlap_default_form",
        {"bucketing": BucketingConfig(bucket_mode="default"), "overlap_scheduling": True},
    ),
    # the full configuration on ap's FSDP schedule: AC, copy-free (coalesced) buckets
    Variant("full_prefetch", {"enable_ac": True, "overlap_scheduling": "prefetch"}),
)


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    spec = TrainSpec(model=ModelConfig(n_layers=1, attention="matmul"), variants=VARIANTS, steps=4)
    return spawn_ranks(run_rank, 2, spec)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("name", [v.name for v in VARIANTS])
def test_compiled_matches_eager_per_step(ranks: list[dict[str, Any]], name: str) -> None:
    for r in ranks:
        v = r["variants"][name]
        assert len(v["losses"]) == 4
        assert v["mismatches"] == [], v["mismatches"]
        assert v["fell_back"] == [False]  # SaveAll replayed the first partition's saves
        assert v["saved"][0]["all_gather_outputs_saved"] == 0


@pytest.mark.multirank
@pytest.mark.slow
def test_ranks_see_different_data_and_saved_sets_agree(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["eager"]["losses"] != ranks[1]["eager"]["losses"]
    for r in ranks:
        v = r["variants"]["ac_off"]
        assert v["saved"][0]["count"] == v["first_partition"]["count"]
        assert v["saved"][0]["bytes"] == v["first_partition"]["bytes"]


@pytest.mark.multirank
@pytest.mark.slow
def test_bucketing_formed_buckets_forward_and_backward(ranks: list[dict[str, Any]]) -> None:
    v = ranks[0]["variants"]["bucketing_overlap"]
    assert [c["is_backward"] for c in v["inner_compiles"]] == [False, True]
    assert sum(v["buckets"]) >= 2  # at least one bucket per graph


@pytest.mark.multirank
@pytest.mark.slow
def test_prefetch_schedule_formed_coalesced_buckets(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        v = r["variants"]["full_prefetch"]
        assert [c["is_backward"] for c in v["inner_compiles"]] == [False, True]
        assert sum(v["buckets"]) >= 2, v["buckets"]


@pytest.mark.heavy  # 110 s of a CI run on 2 cores; real EP through precompile + the backend,
# chunked per exchange, runs in CI on torchtitan's Qwen3-MoE (tests/test_zoo.py)
@pytest.mark.multirank
@pytest.mark.slow
def test_demo_chunk_job_is_real_expert_parallelism_chunked_per_exchange() -> None:
    """``ap-backend demo --chunk``'s job (one layer, two steps, AC in both compilations, without
    bucketing and the saved-set measurements): the MoE's experts are split over the 2 ranks
    and exchange tokens with ``all_to_all_single`` -- 3 per layer forward (counts, dispatch,
    combine), 2 backward -- and the backend runs each exchange once per chunk; losses and grads
    match eager EP run chunk by chunk (``EagerChunked``). Also the numbers the demo table
    prints."""
    # bucketing off (the other multirank tests cover it; it doubles this test's compile time)
    opts = DemoOptions(layers=1, steps=2, chunk=True, bucketing=False)
    spec = dataclasses.replace(
        build_spec(opts), measure_min_cut_ac=False, measure_plain=False, progress=False
    )
    assert spec.model.moe and spec.model.ep
    for r in spawn_ranks(run_rank, 2, spec):
        v = r["variants"]["autoparallel"]
        assert v["chunk_reports"] == 1  # the joint graph was chunked once
        assert v["mismatches"] == [], v["mismatches"]
        ep = expert_parallel_summary(opts, v)
        assert (ep["experts_per_rank"], ep["chunked_regions"]) == (4, 2)
        fw, bw = ep["all_to_alls_forward"], ep["all_to_alls_backward"]
        assert (fw["before"], fw["after"], fw["per_chunk"]) == (3, 6, 3), fw
        assert (bw["before"], bw["after"], bw["per_chunk"]) == (2, 4, 2), bw
