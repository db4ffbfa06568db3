"""Model kit structure and the first compilation on the fake PG (structure only: fake-PG data
is garbage, so no numbers are asserted)."""

from __future__ import annotations

import pytest
import torch
from ap_backend import is_all_gather_output, precompile
from ap_backend.models import ModelConfig, Sharding, Transformer, shard_param
from ap_testing.distributed import FAKE_WORLD_SIZE


def test_parameters_are_dim0_shards_and_grads_come_back_sharded(fake_pg: str) -> None:
    model = Transformer(ModelConfig(n_layers=1, moe=True), Sharding.from_world())
    full = Transformer(ModelConfig(n_layers=1, moe=True), Sharding("", 1, 0))
    for (name, p), (_, q) in zip(model.named_parameters(), full.named_parameters(), strict=True):
        assert p.shape[0] * FAKE_WORLD_SIZE == q.shape[0], name
    model(*model.example_batch(0, 0)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name
    assert any(".moe." in n for n, _ in model.named_parameters())


def test_shard_param_rejects_uneven_dim0() -> None:
    with pytest.raises(ValueError, match="does not divide by world size 8"):
        shard_param(torch.zeros(12, 3), Sharding("g", 8, 0))


def test_sharding_from_world_names_the_fake_group(fake_pg: str) -> None:
    sharding = Sharding.from_world()
    assert (sharding.group_name, sharding.world_size, sharding.rank) == (
        fake_pg,
        FAKE_WORLD_SIZE,
        0,
    )


@pytest.mark.parametrize("gather_dtype", [None, torch.bfloat16])
def test_precompile_tags_every_fsdp_chain_and_saves_no_gathered_weight(
    fake_pg: str, gather_dtype: torch.dtype | None
) -> None:
    model = Transformer(
        ModelConfig(n_layers=1, attention="matmul"), Sharding.from_world(gather_dtype)
    )
    batch = model.example_batch(0, 0)
    pm = precompile(model, batch)
    assert len(pm.fsdp_report.chains) == len(list(model.parameters()))
    if gather_dtype is not None:  # the cast before the all-gather is part of the chain
        assert all(chain.casts for chain in pm.fsdp_report.chains)
    assert pm.first_partition.count > 0
    assert pm.first_partition.all_gather_outputs == ()
    loss = pm(*batch)  # the first compilation's callable runs eagerly too
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_precompile_without_reshard_saves_gathered_weights(fake_pg: str) -> None:
    model = Transformer(ModelConfig(n_layers=1, attention="matmul"), Sharding.from_world())
    pm = precompile(model, model.example_batch(0, 0), reshard_after_forward=False)
    assert len(pm.first_partition.all_gather_outputs) > 0


def test_is_all_gather_output_follows_views_only() -> None:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    ag = g.call_function(torch.ops._c10d_functional.all_gather_into_tensor.default, (x, 2, "0"))
    wait = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (ag,))
    t = g.call_function(torch.ops.aten.t.default, (wait,))
    relu = g.call_function(torch.ops.aten.relu.default, (t,))
    assert is_all_gather_output(wait) and is_all_gather_output(t)
    assert not is_all_gather_output(relu) and not is_all_gather_output(x)


def test_expert_parallel_moe_holds_its_own_whole_experts(fake_pg: str) -> None:
    """``ModelConfig(ep=True)``: each rank holds ``n_experts / world`` whole experts (not
    FSDP-sharded; the router still is); a world the experts do not divide by is refused."""
    from ap_backend.models import ExpertParallelMoE

    cfg = ModelConfig(n_layers=1, moe=True, ep=True)
    model = Transformer(cfg, Sharding.from_world())
    moe = model.layers[0].moe
    assert isinstance(moe, ExpertParallelMoE)
    local = cfg.n_experts // FAKE_WORLD_SIZE
    assert moe.w1.shape == (local, cfg.ffn_dim, cfg.dim)
    assert moe.w2.shape == (local, cfg.dim, cfg.ffn_dim)
    assert moe.router.weight.shape == (cfg.n_experts // FAKE_WORLD_SIZE, cfg.dim)  # FSDP shard
    with pytest.raises(ValueError, match="n_experts 4 does not divide by the world size 8"):
        Transformer(cfg.with_(n_experts=4, top_k=2), Sharding.from_world())
