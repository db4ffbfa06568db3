"""The copy-free bucket form (``bucket_mode="coalesced"``): one coalesced collective per
bucket, each member gathered into (or reduced from) its own tensor -- no ``split_with_sizes_copy``
copying a flat gathered buffer out, no ``_chunk_cat`` copying gradients in.

Runs on a one-rank gloo group (collectives on real data: every graph is executed before and
after the pass); 2-rank numerics through Inductor: ``tests/test_bucketing_stock_compile.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from ap_bucketing import BucketingConfig, OverlapBucketingPass
from ap_testing.collectives import runnable_block_gathers
from ap_testing.distributed import chunked_head_step, single_rank_gloo
from torch.fx.experimental.proxy_tensor import make_fx

COPIES = ("split_with_sizes_copy", "_chunk_cat", "_pre_bucket_all_gather", "_pre_bucket_reduce")


@pytest.fixture(scope="module")
def group() -> Iterator[str]:
    with single_rank_gloo(subgroups=0) as (name,):
        yield name


def _targets(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("reorder", [False, "prefetch"])
def test_all_gather_buckets_are_coalesced_with_no_copy_out(group: str, reorder: bool | str) -> None:
    gm = runnable_block_gathers(group)
    inputs = [torch.randn(n.meta["val"].shape) for n in gm.graph.find_nodes(op="placeholder")]
    expected = gm(*inputs)
    bucketing = OverlapBucketingPass(
        BucketingConfig(bucket_mode="coalesced", bucket_cap_mb=1000.0), cpu=True, reorder=reorder
    )
    bucketing(gm.graph)
    gm.recompile()
    assert bucketing.reports[-1]["collectives"]["all_gather"] == (8, 4)  # one per block
    targets = _targets(gm)
    assert sum("all_gather_into_tensor_coalesced" in t for t in targets) == 4
    assert sum("pack_shards" in t for t in targets) == 4
    assert not [t for t in targets if any(c in t for c in COPIES)]
    torch.testing.assert_close(gm(*inputs), expected, rtol=0, atol=0)


def test_gradient_reduce_scatters_are_coalesced_and_the_write_order_kept(group: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(32, 16)
    shards = [torch.randn(16, 16, requires_grad=True) for _ in range(5)]
    gm = make_fx(chunked_head_step, tracing_mode="fake")(x, *shards)
    with torch.no_grad():
        expected = gm(x, *shards)
    config = BucketingConfig(bucket_mode="coalesced", bucket_cap_mb=1000.0, max_topo_span=None)
    bucketing = OverlapBucketingPass(config, cpu=True, reorder="prefetch")
    bucketing(gm.graph)
    gm.recompile()
    report = bucketing.reports[-1]
    assert report["collectives"]["reduce_scatter"] == (5, 2)  # the add_-accumulated one alone
    assert report["collectives"]["all_gather"] == (5, 1)
    targets = _targets(gm)
    assert any("reduce_scatter_tensor_coalesced" in t for t in targets)
    assert not [t for t in targets if any(c in t for c in COPIES)]
    with torch.no_grad():
        got = gm(x, *shards)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_torchs_overlap_scheduler_is_refused_naming_the_alternatives() -> None:
    with pytest.raises(ValueError, match=r"coalesced.*reorder=True.*'prefetch'"):
        OverlapBucketingPass(BucketingConfig(bucket_mode="coalesced"), cpu=True, reorder=True)


def test_the_pack_op_is_registered_by_making_the_pass_before_any_compile() -> None:
    """A restarted job's warm FX-graph cache serves compiled code calling
    ``ap_bucketing::pack_shards`` and ``cast_shards`` without running the pass that would register it on first
    use: making the pass registers it (a fresh process: this one may have it already)."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from ap_bucketing import BucketingConfig, OverlapBucketingPass\n"
        "assert not hasattr(torch.ops.ap_bucketing, 'pack_shards')\n"
        "OverlapBucketingPass(BucketingConfig(bucket_mode='custom_ops'), cpu=True)\n"
        "assert not hasattr(torch.ops.ap_bucketing, 'pack_shards')\n"
        "assert not hasattr(torch.ops.ap_bucketing, 'cast_shards')\n"
        "OverlapBucketingPass(BucketingConfig(bucket_mode='coalesced'), reorder='prefetch')\n"
        "x = torch.ones(3, dtype=torch.float32)\n"
        "out = torch.ops.ap_bucketing.pack_shards([x, x], torch.bfloat16)\n"
        "assert out.dtype == torch.bfloat16 and out.shape == (6,)\n"
        "outs = torch.ops.ap_bucketing.cast_shards([out, x], torch.float64)\n"
        "assert [o.dtype for o in outs] == [torch.float64] * 2\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_pack_casts_and_concatenates_the_shards_in_one_multi_tensor_copy() -> None:
    """``pack_shards`` is the bucket's whole input side: each shard cast to the gather dtype
    and laid end to end, as a ``copy_`` per shard would (non-contiguous and mixed-dtype shards
    included), in one ``_foreach_copy_`` call -- on CUDA one multi-tensor kernel instead of a
    kernel per member."""
    from ap_bucketing._coalesced import pack_shards_op
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    shards = [
        torch.randn(4, 3),
        torch.randn(3, 5).t(),  # non-contiguous
        torch.randn(7, dtype=torch.float64),
        torch.randn(0),
    ]
    pack = pack_shards_op()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = pack(shards, torch.bfloat16)
    expected = torch.cat([s.reshape(-1).to(torch.bfloat16) for s in shards])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    names = [e.name for e in prof.events()]
    assert names.count("aten::_foreach_copy_") == 1, names


def _mixed_precision_step(x: torch.Tensor, *shards: torch.Tensor) -> list[torch.Tensor]:
    """fp32 shards gathered in bf16, as FSDP2 gathers with ``param_dtype=bf16``: the backward
    reduce-scatters bf16 gradients and casts each reduced shard back to fp32 after its wait.
    The last weight is scaled before its cast, so its reduced shard is cast and then doubled:
    a cast that feeds compute."""
    from ap_testing.distributed import gather_autograd

    last = gather_autograd((shards[-1] * 2).to(torch.bfloat16))
    weights = [gather_autograd(s.to(torch.bfloat16)) for s in shards[:-1]] + [last]
    h = x.to(torch.bfloat16)
    for w in weights:
        h = torch.relu(h @ w.t())
    loss = h.float().pow(2).mean()
    return [loss, *torch.autograd.grad(loss, shards)]


def _bucketed_mixed_precision_step(
    bucket_cap_mb: float,
) -> tuple[torch.fx.GraphModule, dict[str, Any], Callable[[], None]]:
    """:func:`_mixed_precision_step` traced with Inductor's decompositions (as its post-grad
    graph has them: casts are ``prims.convert_element_type``) and bucketed in the copy-free
    form under ``bucket_cap_mb``; returns the graph, the pass's report, and a check that the
    bucketed graph runs on the group to the unbucketed graph's outputs, bit for bit."""
    from torch._inductor.decomposition import select_decomp_table

    torch.manual_seed(0)
    x = torch.randn(8, 16)
    shards = [torch.randn(16, 16, requires_grad=True) for _ in range(4)]
    gm = make_fx(
        _mixed_precision_step, tracing_mode="fake", decomposition_table=select_decomp_table()
    )(x, *shards)
    with torch.no_grad():
        expected = gm(x, *shards)
    config = BucketingConfig(
        bucket_mode="coalesced", bucket_cap_mb=bucket_cap_mb, max_topo_span=None
    )
    bucketing = OverlapBucketingPass(config, cpu=True, reorder="prefetch")
    bucketing(gm.graph)
    gm.recompile()

    def run_matches() -> None:
        with torch.no_grad():
            got = gm(x, *shards)
        for a, b in zip(got, expected, strict=True):
            assert a.dtype == b.dtype and a.stride() == b.stride()
            torch.testing.assert_close(a, b, rtol=0, atol=0)

    return gm, bucketing.reports[-1], run_matches


def test_a_reduce_scatter_buckets_output_casts_are_one_call(group: str) -> None:
    """The reduced shards cast back to fp32 for the output are cast by one ``cast_shards``
    call (no Inductor kernel per shard shape); the cast that feeds the doubling stays a cast of
    its own; the gradients are bit-identical to the unbucketed graph's."""
    from ap_bucketing._shard_casts import cast_shards_op

    gm, report, run_matches = _bucketed_mixed_precision_step(bucket_cap_mb=1000.0)
    assert report["collectives"]["reduce_scatter"] == (4, 1)
    (merged,) = gm.graph.find_nodes(op="call_function", target=cast_shards_op())
    shard_waits = merged.args[0]
    assert isinstance(shard_waits, list) and len(shard_waits) == 3
    assert all("wait_tensor" in str(w.target) for w in shard_waits)
    # the fourth reduced shard: cast, then doubled -- left for Inductor to fuse
    rs = gm.graph.find_nodes(
        op="call_function",
        target=torch.ops._c10d_functional.reduce_scatter_tensor_coalesced.default,
    )
    waits = [w for g in rs[0].users for w in g.users]
    (kept,) = [w for w in waits if w not in shard_waits]
    (cast,) = kept.users
    assert cast.target is torch.ops.prims.convert_element_type.default
    assert [u.target for u in cast.users] == [torch.ops.aten.mul.Tensor]
    run_matches()


def test_a_gather_no_bucket_takes_casts_through_the_pack(group: str) -> None:
    """With a byte cap no two collectives fit under, nothing is bucketed, and each FSDP
    collective keeps its own all-gather or reduce-scatter. An all-gather's cast still goes
    through the bucket's pack (``pack_shards`` of its one shard, viewed back), where Inductor
    would fuse it into a kernel source no block shares; a lone reduce-scatter's output casts
    stay Inductor's (through ``cast_shards`` its wait would move to the end, and its unsharded
    gradient's life with it). Gradients bit-identical."""
    from ap_bucketing._coalesced import pack_shards_op
    from ap_bucketing._shard_casts import cast_shards_op

    gm, report, run_matches = _bucketed_mixed_precision_step(bucket_cap_mb=1e-4)
    collectives = report["collectives"]
    assert collectives["all_gather"] == (4, 4) and collectives["reduce_scatter"] == (4, 4)
    all_gathers = gm.graph.find_nodes(
        op="call_function", target=torch.ops._c10d_functional.all_gather_into_tensor.default
    )
    assert len(all_gathers) == 4
    for ag in all_gathers:
        view = ag.args[0]
        assert isinstance(view, torch.fx.Node) and view.target is torch.ops.aten.view.default
        assert view.args[0].target is pack_shards_op()  # type: ignore[union-attr]
    assert not gm.graph.find_nodes(op="call_function", target=cast_shards_op())
    kept = [
        n
        for n in gm.graph.find_nodes(
            op="call_function", target=torch.ops.prims.convert_element_type.default
        )
        if "wait_tensor" in str(n.args[0].target)  # type: ignore[union-attr]
    ]
    assert (
        sorted(str(u.target) for c in kept for u in c.users) == ["aten.mul.Tensor"] + ["output"] * 3
    )
    run_matches()


def test_cast_shards_casts_each_shard_in_one_multi_tensor_copy() -> None:
    """Each output has its shard's shape, strides and values cast to the dtype, in one
    ``_foreach_copy_`` call (on CUDA one multi-tensor kernel, not one per shard)."""
    from ap_bucketing._shard_casts import cast_shards_op
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    shards = [
        torch.randn(4, 3, dtype=torch.bfloat16),
        torch.randn(3, 5, dtype=torch.bfloat16).t(),  # non-contiguous
        torch.randn(7, dtype=torch.bfloat16),
        torch.randn(0, dtype=torch.bfloat16),
    ]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        outs = cast_shards_op()(shards, torch.float32)
    for out, shard in zip(outs, shards, strict=True):
        assert out.dtype == torch.float32
        assert out.shape == shard.shape and out.stride() == shard.stride()
        torch.testing.assert_close(out, shard.to(torch.float32), rtol=0, atol=0)
    names = [e.name for e in prof.events()]
    assert names.count("aten::_foreach_copy_") == 1, names
