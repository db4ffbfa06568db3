"""Every torch setting ``autoparallel_backend`` touches is scoped to its compile calls.

After a compile (the forward, and the backward AOTAutograd compiles lazily on the first
``.backward()``), and after a compile that raises, these are back to what they were:
Inductor's ``custom_partitioner_fn``, functorch's ``joint_custom_pass``, ap-bucketing's patch,
``torch.compiler.config.cache_key_tag``, the overlap-scheduling keys
(``aten_distributed_optimizations.*``, ``post_grad_custom_post_pass``), the roofline estimator
and the side-effect registry ``wait_tensor_dce()`` edits -- and a later plain
``torch.compile`` of a fresh function never reaches our partitioner. Fake PG, real Inductor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ap_bucketing
import pytest
import torch
import torch.fx
from ap_backend import autoparallel_backend
from ap_backend.models import ShardedLinear, Sharding
from ap_bucketing._compat import roofline_estimator_site
from ap_partitioner import SaveAllPartitioner
from ap_testing.concurrency import Boom
from torch._inductor.custom_graph_pass import CustomPartitionerFn

#: the GPU-only estimator ``cpu_overlap_estimators`` replaces (``estimate_roofline_runtime_ms``;
#: 2.11's ``estimate_runtime_analytical``)
ESTIMATOR = roofline_estimator_site()[1]


class SpyPartitioner(CustomPartitionerFn):
    """Counts its calls and records the settings it ran under; SaveAll, or ``Boom``."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.calls = 0
        self.seen: list[dict[str, Any]] = []

    def __call__(
        self, gm: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        self.calls += 1
        self.seen.append(settings())
        if self.fail:
            raise Boom("this partitioner fails on purpose")
        return SaveAllPartitioner()(gm, joint_inputs, **kwargs)

    def uuid(self) -> Any:
        return None


def settings() -> dict[str, Any]:
    """Every setting the backend may change, as comparable values (objects by identity)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    import torch._inductor.fx_passes.overlap_scheduling as overlap
    import torch.fx.node as fx_node

    inductor = inductor_config.get_config_copy()
    wait = torch.ops._c10d_functional.wait_tensor.default
    return {
        "custom_partitioner_fn": id(inductor_config.custom_partitioner_fn),
        "joint_custom_pass": id(functorch_config.joint_custom_pass),
        "post_grad_custom_post_pass": id(inductor_config.post_grad_custom_post_pass),
        "overlap_keys": {
            k: v if isinstance(v, bool | int | float | str | type(None)) else id(v)
            for k, v in inductor.items()
            if k.startswith("aten_distributed_optimizations.")
        },
        "bucketing_installed": ap_bucketing.is_installed(),
        "cache_key_tag": torch.compiler.config.cache_key_tag,
        "roofline": id(getattr(overlap, ESTIMATOR)),
        "wait_tensor_side_effectful": wait in fx_node._side_effectful_functions,
    }


def _model() -> torch.nn.Module:
    gen = torch.Generator().manual_seed(0)
    return torch.nn.Sequential(ShardedLinear(16, 32, Sharding.from_world(), gen), torch.nn.ReLU())


def _assert_plain_compile_skips(spy: SpyPartitioner) -> None:
    """A fresh function under stock ``torch.compile`` (Inductor, with a joint partition)."""
    calls = spy.calls

    def fresh(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() * 3).sum()

    x = torch.randn(8, requires_grad=True)
    fresh_compiled: Any = torch.compile(fresh)
    fresh_compiled(x).backward()
    assert spy.calls == calls, "a plain torch.compile reached the backend's partitioner"


@pytest.mark.slow
@pytest.mark.parametrize("bucketing", [True, False], ids=["bucketing", "overlap_only"])
def test_settings_restored_after_forward_and_lazy_backward(fake_pg: str, bucketing: bool) -> None:
    """With bucketing, ap-bucketing's pass patches torch (and the estimators) inside each
    inner compile; without, the backend's own ``inner_compile`` enters the CPU estimators."""
    before = settings()
    spy = SpyPartitioner()
    backend = autoparallel_backend(
        enable_ac=True, bucketing=bucketing, overlap_scheduling=True, partitioner=spy
    )
    loss = torch.compile(_model(), backend=backend)(torch.randn(4, 16)).sum()
    # the settings were live while the joint graph was split ...
    during = spy.seen[0]
    assert during["custom_partitioner_fn"] != before["custom_partitioner_fn"]
    assert during["joint_custom_pass"] != before["joint_custom_pass"]
    overlap = ("overlap_keys", "post_grad_custom_post_pass")
    assert [during[k] for k in overlap] != [before[k] for k in overlap]
    assert during["wait_tensor_side_effectful"] != before["wait_tensor_side_effectful"]
    # ... and are gone once the forward compile returned
    assert settings() == before
    loss.backward()  # the backward compiles now, outside the backend call
    assert [c["is_backward"] for c in backend.inner_compiles] == [False, True]
    if bucketing:
        assert backend.bucketing_stats, "bucketing never ran: the check above proves nothing"
    assert settings() == before
    _assert_plain_compile_skips(spy)
    assert spy.calls == 1


@pytest.mark.slow
def test_settings_restored_after_a_failing_compile(fake_pg: str) -> None:
    before = settings()
    spy = SpyPartitioner(fail=True)
    backend = autoparallel_backend(
        enable_ac=True, bucketing=True, overlap_scheduling=True, partitioner=spy
    )
    with pytest.raises(Exception, match="fails on purpose"):
        torch.compile(_model(), backend=backend)(torch.randn(4, 16))
    assert spy.calls == 1
    assert settings() == before
    _assert_plain_compile_skips(spy)
