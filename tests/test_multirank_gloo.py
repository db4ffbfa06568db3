"""2 gloo ranks, 4 SGD steps: the two-stage compile (precompile + autoparallel_backend) matches
eager per step -- loss and every parameter's (sharded) grad at rtol 1e-5 fp32 -- with AC off,
AC on, and ap-bucketing with overlap scheduling in both of torch's bucket forms, each named
explicitly (``"custom_ops"``, the default, gave NaN losses until ap-bucketing kept the overlap
scheduler from hoisting reads of a bucket's members above the ``out=`` copy that fills them).
One spawn runs all four configurations."""

from __future__ import annotations

from typing import Any

import pytest
from ap_backend.demo import TrainSpec, Variant, run_rank, spawn_ranks
from ap_backend.models import ModelConfig
from ap_bucketing import BucketingConfig

VARIANTS = (
    Variant("ac_off", {"enable_ac": False}),
    Variant("ac_on", {"enable_ac": True}),
    Variant("bucketing_overlap", {"bucketing": True, "overlap_scheduling": True}),
    Variant(
        "bucketing_overlap_default_form",
        {"bucketing": BucketingConfig(bucket_mode="default"), "overlap_scheduling": True},
    ),
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
def test_moe_with_ep_chunk_matches_eager_chunking() -> None:
    from ap_epchunk import ChunkConfig

    chunk = ChunkConfig(module_patterns=("layers.*.moe",), num_chunks=2)
    spec = TrainSpec(
        model=ModelConfig(n_layers=1, attention="matmul", moe=True, batch=4),
        variants=(Variant("chunk", {"ep_chunk": chunk}),),
        steps=2,
    )
    for r in spawn_ranks(run_rank, 2, spec):
        v = r["variants"]["chunk"]
        assert v["chunk_reports"] == 1  # the joint graph was chunked once
        assert v["mismatches"] == [], v["mismatches"]
