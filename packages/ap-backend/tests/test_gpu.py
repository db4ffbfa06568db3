"""The GPU check's tests (``gpu`` marker), each on CPU and on CUDA (``ap_testing.devices``).

The CPU twins run in every ``uv run pytest`` and in every ``scripts/matrix`` cell (every
supported torch, 2.11 included, no patches of torch); the CUDA variants skip with the reason
where CUDA is not available. ``scripts/gpu-check`` runs them with ``--device cuda``.

* world-1 numerics vs eager: ``precompile`` + ``autoparallel_backend`` in the default, AC and
  full configurations, on the demo's model kit, no fallback;
* one training step on the fake process group at world 8 with SaveAll and bucketing, in the
  default's copy-free bucket form and in ``"custom_ops"`` (structure: buckets formed, no
  all-gathered weight saved, no fallback; fake-PG data is garbage);
* the demo's eager-checked training loop (``ap_backend.demo.run_rank``) under a real one-rank
  process group (gloo on CPU, NCCL on CUDA), plus a compiled all-gather + ``wait_tensor`` on that
  group (the demo's model issues no collective at world size 1).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from typing import Any

import ap_tags
import pytest
import torch
import torch.distributed as dist
from ap_backend import autoparallel_backend, precompile
from ap_backend.demo import TrainSpec, Variant, run_rank
from ap_backend.models import ModelConfig, Sharding, Transformer, single_rank_sharding
from ap_bucketing import BucketingConfig
from ap_testing.devices import DEVICES
from torch._inductor.utils import run_and_get_code

#: small shapes: seconds per compile on CPU
CFG = ModelConfig(dim=32, n_layers=1, n_heads=2, ffn_dim=64, vocab=64, seq_len=8, batch=2)

CONFIGS: dict[str, tuple[dict[str, Any], bool]] = {
    # name: (autoparallel_backend kwargs, AC joint pass in the first compilation too)
    "default": ({}, False),
    "ac": ({"enable_ac": True}, True),
    "full": ({"enable_ac": True, "bucketing": True, "overlap_scheduling": True}, True),
}


def _model(device: str, sharding: Sharding) -> Transformer:
    torch.manual_seed(0)
    return Transformer(CFG, sharding).to(device)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("device", DEVICES)
def test_world1_numerics_match_eager(device: str, config: str) -> None:
    kwargs, first_ac = CONFIGS[config]
    eager = _model(device, single_rank_sharding())
    compiled_model = _model(device, single_rank_sharding())
    tokens, targets = (t.to(device) for t in eager.example_batch(0, 0))
    eager(tokens, targets).backward()

    joint_pass = ap_tags.ac_joint_pass() if first_ac else None
    pm = precompile(compiled_model, (tokens, targets), joint_pass=joint_pass)
    backend = autoparallel_backend(**kwargs)
    loss = torch.compile(pm, backend=backend)(tokens, targets)
    loss.backward()

    assert backend.partition_reports, "the backend's partitioner never ran"
    assert not any(r.fell_back for r in backend.partition_reports), [
        r.fallback_reason for r in backend.partition_reports
    ]
    torch.testing.assert_close(loss, eager(tokens, targets), rtol=1e-5, atol=1e-6)
    for (name, p), (_, q) in zip(
        eager.named_parameters(), compiled_model.named_parameters(), strict=True
    ):
        assert q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


#: ``bucketing=`` of the fake-PG step: ap's own choice (the copy-free form, one coalesced
#: collective per bucket) and ``BucketingConfig()``'s flat ``"custom_ops"`` buckets
BUCKET_FORMS: dict[str, Any] = {"default": True, "custom_ops": BucketingConfig()}


@pytest.mark.parametrize("form", list(BUCKET_FORMS))
@pytest.mark.parametrize("device", DEVICES)
def test_fake_pg_world8_step_with_save_all_and_bucketing(
    fake_pg: str, device: str, form: str
) -> None:
    model = Transformer(CFG.with_(n_layers=2), Sharding.from_world()).to(device)
    batch = tuple(t.to(device) for t in model.example_batch(0, 0))
    pm = precompile(model, batch)
    backend = autoparallel_backend(bucketing=BUCKET_FORMS[form])
    compiled = torch.compile(pm, backend=backend)
    _, code = run_and_get_code(lambda: compiled(*batch).backward())
    coalesced = [
        op in "\n".join(code)
        for op in ("all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced")
    ]
    assert coalesced == ([True, True] if form == "default" else [False, False]), coalesced
    assert all(p.grad is not None for p in model.parameters())
    assert [r.fell_back for r in backend.partition_reports] == [False]
    assert all(s.all_gather_outputs == () for s in backend.saved), backend.saved
    assert sum(s.buckets for s in backend.bucketing_stats) > 0, backend.bucketing_stats


@pytest.fixture
def one_rank_world(device: str) -> Iterator[str]:
    """A real one-rank default process group: gloo for the CPU twin, NCCL for CUDA."""
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda" and not dist.is_nccl_available():
        pytest.skip(f"torch {torch.__version__} has no NCCL")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(backend, rank=0, world_size=1, init_method=f"file://{tmp}/store")
        try:
            yield backend
        finally:
            dist.destroy_process_group()
            torch.compiler.reset()


@pytest.mark.parametrize("device", DEVICES)
def test_demo_training_loop_under_a_real_one_rank_group(one_rank_world: str, device: str) -> None:
    full = CONFIGS["full"][0]
    spec = TrainSpec(
        model=CFG,
        variants=(Variant("full", dict(full), first_compile_ac=True),),
        steps=2,
        device=device,
    )
    result = run_rank(0, 1, spec)
    out = result["variants"]["full"]
    assert out["mismatches"] == [], out["mismatches"]
    assert out["fell_back"] == [False]
    assert len(out["losses"]) == 2

    # the model kit issues no collective at world size 1: compile one all-gather + wait_tensor
    # on the real group through the backend (NCCL's streams on CUDA)
    from ap_backend import _compat

    group = dist.group.WORLD
    assert group is not None
    _compat.load_functional_collectives()

    def gathered(x: torch.Tensor) -> torch.Tensor:
        return _compat.all_gather_wait(x * 2, 1, group.group_name).sum()

    x = torch.randn(4, 3, device=device, requires_grad=True)
    loss = torch.compile(gathered, backend=autoparallel_backend(bucketing=True))(x)
    loss.backward()
    torch.testing.assert_close(loss, (x * 2).sum())
    assert x.grad is not None
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
