"""The lazily compiled backward sees the backend's overlap/bucketing settings (fake PG, one
sharded linear layer, real Inductor codegen), and each compile emits its trace artifacts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ap_backend import autoparallel_backend
from ap_backend.models import ShardedLinear, Sharding


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
    fake_pg: str, monkeypatch: pytest.MonkeyPatch, bucketing: bool
) -> None:
    import torch._logging._internal as trace_internal
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
    emitted: list[str] = []
    real_trace = trace_internal.trace_structured

    def capture(kind: str, metadata_fn: Any = dict, **kw: Any) -> None:
        if kind == "artifact":
            emitted.append(metadata_fn()["name"])
        real_trace(kind, metadata_fn=metadata_fn, **kw)

    monkeypatch.setattr(trace_internal, "trace_structured", capture)
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
