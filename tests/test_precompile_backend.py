"""Two-stage compile on the fake PG (structure only): the tags of the first compilation reach
the second, so SaveAll reproduces the first partition's saved set and saves no all-gather
output."""

from __future__ import annotations

from collections import Counter

from ap_backend import measure_saved, precompile
from ap_backend.models import ModelConfig, Sharding, Transformer


def _model() -> Transformer:
    return Transformer(ModelConfig(n_layers=2, attention="matmul"), Sharding.from_world())


def test_second_partition_saves_exactly_the_first_set(fake_pg: str) -> None:
    model = _model()
    batch = model.example_batch(0, 0)
    pm = precompile(model, batch)
    first = pm.first_partition
    assert first.count > 0
    assert first.all_gather_outputs == ()
    assert len(pm.fsdp_report.chains) == len(list(model.parameters()))
    second = measure_saved(pm, batch, partitioner="save_all", enable_ac=False)
    assert Counter(second.signatures) == Counter(first.signatures)
    assert second.nbytes == first.nbytes
    assert second.all_gather_outputs == ()
    # With the AC pass, SaveAll still replays the first set (AC can only add MUST_SAVE).
    with_ac = measure_saved(pm, batch, partitioner="save_all", enable_ac=True)
    assert with_ac.all_gather_outputs == ()


def test_without_fsdp_tags_min_cut_saves_all_gather_outputs(fake_pg: str) -> None:
    """The rule the tags enforce: untagged, min-cut keeps gathered weights for backward."""
    model = _model()
    batch = model.example_batch(0, 0)
    untagged = measure_saved(model, batch, partitioner="min_cut", enable_ac=False)
    assert len(untagged.all_gather_outputs) > 0
    pm = precompile(model, batch)
    tagged = measure_saved(pm, batch, partitioner="min_cut", enable_ac=False)
    assert tagged.all_gather_outputs == ()
