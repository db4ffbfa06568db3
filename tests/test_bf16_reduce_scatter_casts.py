"""Gradients reduce-scattered in bf16 and cast back to fp32 in one call per bucket, on 2 gloo
ranks through Inductor.

The model kit gathers its fp32 shards in bf16 (FSDP2's ``param_dtype=bf16`` with
``reduce_dtype=bf16``): the backward reduce-scatters bf16 gradients and casts each reduced shard
to fp32. With the default's copy-free buckets those casts are one ``ap_bucketing::cast_shards``
call per bucket, where Inductor would build and launch a cast kernel per shard; a collective no
bucket takes (the embedding, the head) casts through the same ops. The test runs a real step on
each rank (eager, the default, the default without bucketing) and checks that the default's
backward calls ``cast_shards``, that no kernel of its is a lone cast or has a gather's cast
fused in, and that it gives the gradients the unbucketed compile gives.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch

WORLD = 2
_CAST_LAUNCH = re.compile(r"\bcpp_fused_convert_element_type_\d+\(")
#: a kernel an all-gather's input cast was fused into (Inductor names it after its sources)
_GATHER_CAST_KERNEL = re.compile(r"^cpp_fused_\w*all_gather_into_tensor\w* =", re.M)


def _rank(rank: int, world: int) -> dict[str, Any]:
    from ap_backend import autoparallel_backend, precompile
    from ap_backend.models import ModelConfig, Sharding, Transformer
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    # one layer: a block's bucket and the head's; a second layer repeats the block's (124 s of a
    # 2-worker run with two, 2026-12-04)
    config = ModelConfig(dim=64, n_layers=1, n_heads=4, ffn_dim=128, vocab=128, seq_len=32, batch=2)
    eager = Transformer(config, Sharding.from_world(torch.bfloat16))
    batch = eager.example_batch(0, rank)
    grads: dict[str, list[torch.Tensor]] = {}
    codes: dict[str, list[str]] = {}
    for name, bucketing in (("default", True), ("unbucketed", False)):
        torch._dynamo.reset()
        model = copy.deepcopy(eager)
        compiled = torch.compile(
            precompile(model, batch), backend=autoparallel_backend(bucketing=bucketing)
        )

        def step(compiled: Any = compiled) -> None:
            compiled(*batch).backward()

        _, codes[name] = run_and_get_code(step)
        grads[name] = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    eager(*batch).backward()
    grads["eager"] = [p.grad.clone() for p in eager.parameters()]  # type: ignore[union-attr]
    backward = codes["default"][-1]
    pairs = list(zip(grads["default"], grads["unbucketed"], grads["eager"], strict=True))
    return {  # plain values: tensors do not outlive the rank's process on the way back
        "cast_shards_calls": backward.count("torch.ops.ap_bucketing.cast_shards.default("),
        # launches of kernels that only cast (one per reduced shard without cast_shards)
        "cast_launches": len(_CAST_LAUNCH.findall(backward)),
        "unbucketed_cast_launches": len(_CAST_LAUNCH.findall(codes["unbucketed"][-1])),
        "gather_cast_kernels": sum(len(_GATHER_CAST_KERNEL.findall(c)) for c in codes["default"]),
        "unbucketed_gather_cast_kernels": sum(
            len(_GATHER_CAST_KERNEL.findall(c)) for c in codes["unbucketed"]
        ),
        "layouts_agree": all(
            d.dtype == u.dtype == torch.float32 and d.stride() == u.stride() for d, u, _ in pairs
        ),
        "max_abs_vs_unbucketed": max(float((d - u).abs().max()) for d, u, _ in pairs),
        "max_rel_vs_eager": max(
            float((d - e).abs().max() / e.abs().max().clamp_min(1e-12)) for d, _, e in pairs
        ),
    }


@pytest.fixture(scope="module")
def ranks(spawn_from_root: Any) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = spawn_from_root(_rank, WORLD, timeout_s=900.0)
    return found


@pytest.mark.multirank
@pytest.mark.slow
def test_bucketed_bf16_reduced_shards_are_cast_in_one_call_and_match(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        # one call per reduce-scatter bucket: a block's weights, and the final norm with the head
        assert r["cast_shards_calls"] >= 2, r["cast_shards_calls"]
        assert r["cast_launches"] <= 2 < r["unbucketed_cast_launches"], r
        # every gather's cast, a lone weight's included, is a pack_shards call
        assert r["gather_cast_kernels"] == 0 < r["unbucketed_gather_cast_kernels"], r
        assert r["layouts_agree"]
        # the same bf16 sums cast exactly: only the collective's form differs
        assert r["max_abs_vs_unbucketed"] == 0.0, r
        # eager rounds its bf16 compute differently from Inductor's fused kernels
        assert r["max_rel_vs_eager"] < 5e-2, r
