"""Two-stage compile on the fake PG (structure only): the tags of the first compilation reach
the second, so SaveAll reproduces the first partition's saved set and saves no all-gather
output; the lazily compiled backward sees the overlap/bucketing settings."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
from ap_backend import autoparallel_backend, precompile
from ap_backend._measure import measure_saved
from ap_backend.models import ModelConfig, ShardedLinear, Sharding, Transformer

from tests._fakepg import fake_world


@pytest.fixture()
def world() -> Iterator[None]:
    torch._dynamo.reset()
    with fake_world():
        yield
    torch._dynamo.reset()


def _model() -> Transformer:
    return Transformer(ModelConfig(n_layers=2, attention="matmul"), Sharding.from_world())


def test_second_partition_saves_exactly_the_first_set(world: None) -> None:
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


def test_without_fsdp_tags_min_cut_saves_all_gather_outputs(world: None) -> None:
    """The rule the tags enforce: untagged, min-cut keeps gathered weights for backward."""
    model = _model()
    batch = model.example_batch(0, 0)
    untagged = measure_saved(model, batch, partitioner="min_cut", enable_ac=False)
    assert len(untagged.all_gather_outputs) > 0
    pm = precompile(model, batch)
    tagged = measure_saved(pm, batch, partitioner="min_cut", enable_ac=False)
    assert tagged.all_gather_outputs == ()


class _OneLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.lin = ShardedLinear(16, 32, Sharding.from_world(), gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu().sum()


@pytest.mark.slow
@pytest.mark.parametrize("bucketing", [False, True])
def test_lazy_backward_compile_sees_overlap_settings(
    world: None, monkeypatch: pytest.MonkeyPatch, bucketing: bool
) -> None:
    from torch._inductor import compile_fx as cfx
    from torch._inductor import config as inductor_config

    seen: list[dict[str, Any]] = []
    original = cfx.compile_fx_inner

    def spy(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        opts = inductor_config.aten_distributed_optimizations
        seen.append(
            {
                "is_backward": kwargs.get("is_backward", False),
                "overlap": opts.enable_overlap_scheduling,
                "fusion_regions": opts.enable_fusion_regions,
                "post_pass": type(inductor_config.post_grad_custom_post_pass).__name__,
            }
        )
        return original(gm, example_inputs, **kwargs)

    monkeypatch.setattr(cfx, "compile_fx_inner", spy)
    import ap_backend._artifacts as artifacts

    emitted: list[str] = []
    real_trace = artifacts.trace_structured

    def capture(kind: str, metadata_fn: Any = dict, **kw: Any) -> None:
        emitted.append(metadata_fn()["name"])
        real_trace(kind, metadata_fn=metadata_fn, **kw)

    monkeypatch.setattr(artifacts, "trace_structured", capture)
    module = _OneLinear()
    backend = autoparallel_backend(overlap_scheduling=True, bucketing=bucketing)
    loss = torch.compile(module, backend=backend)(torch.randn(4, 16))
    assert [s["is_backward"] for s in seen] == [False]  # backward not compiled yet
    loss.backward()  # outside every scope the backend entered
    assert [s["is_backward"] for s in seen] == [False, True]
    bw = seen[1]
    assert {"ap_partition_report", "ap_saved_activations"} <= set(emitted)
    if bucketing:
        assert "ap_bucketing_stats" in emitted
        assert bw["post_pass"] == "OverlapBucketingPass"
        assert len(backend.bucketing_stats) >= 1
    else:
        assert bw["overlap"] is True
        assert bw["fusion_regions"] is (torch.cuda.is_available())
    assert not inductor_config.aten_distributed_optimizations.enable_overlap_scheduling
