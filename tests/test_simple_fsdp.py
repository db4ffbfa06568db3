"""precompile + autoparallel_backend on torchtitan's SimpleFSDP (DTensor parameters behind
parametrized properties), 2 gloo ranks, 3 SGD steps: loss and every rank's gradient shard match
eager SimpleFSDP at rtol 1e-5; ap-tags finds and tags every all-gather DTensor redistribution
produces, so SaveAll saves no all-gather output where plain ``torch.compile`` saves some."""

from __future__ import annotations

from typing import Any

import pytest
from ap_backend.demo import TrainSpec, Variant, run_rank, spawn_ranks
from ap_backend.models import ModelConfig

pytest.importorskip("torchtitan.experiments.graph_trainer.simple_fsdp")


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    spec = TrainSpec(
        model=ModelConfig(n_layers=1, attention="matmul"),
        variants=(Variant("ac_off", {"enable_ac": False}),),
        steps=3,
        fsdp="simple",
        measure_plain=True,
    )
    return spawn_ranks(run_rank, 2, spec)


@pytest.mark.multirank
@pytest.mark.slow
def test_simple_fsdp_compiled_matches_eager_per_step(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["eager"]["losses"] != ranks[1]["eager"]["losses"]  # different data
    for r in ranks:
        v = r["variants"]["ac_off"]
        assert len(v["losses"]) == 3
        assert v["mismatches"] == [], v["mismatches"]
        assert v["fell_back"] == [False]


@pytest.mark.multirank
@pytest.mark.slow
def test_simple_fsdp_all_gathers_are_tagged_and_never_saved(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        v = r["variants"]["ac_off"]
        assert v["fsdp_chains"] == v["n_params"] > 0  # one tagged chain per DTensor parameter
        assert v["first_partition"]["all_gather_outputs_saved"] == 0
        assert v["saved"][0]["all_gather_outputs_saved"] == 0
        assert r["plain_compile"]["all_gather_outputs_saved"] > 0
