"""OverlapBucketingPass at FX level (fake process group), config patches, CPU estimators."""

from __future__ import annotations

import ap_bucketing
import pytest
import torch
import torch._inductor.fx_passes.overlap_scheduling as overlap_scheduling
import torch.fx as fx
from ap_bucketing import (
    BucketingConfig,
    OverlapBucketingPass,
    collect_stats,
    cpu_overlap_estimators,
    cpu_runtime_estimation,
    max_consec_compute_between_rs,
    overlap_config_patches,
)
from ap_bucketing._compat import roofline_estimator_site
from ap_testing.collectives import backward_like_graph

#: the GPU-only estimator ``cpu_overlap_estimators`` replaces (``estimate_roofline_runtime_ms``;
#: 2.11's ``estimate_runtime_analytical``)
ESTIMATOR = roofline_estimator_site()[1]

_c10d = torch.ops._c10d_functional


def _count(gm: fx.GraphModule, *targets: object) -> int:
    return sum(len(gm.graph.find_nodes(op="call_function", target=t)) for t in targets)


_AGS = (_c10d.all_gather_into_tensor.default, _c10d.all_gather_into_tensor_out.default)


def test_prebucketing_only_merges_all_gathers_and_reduce_scatters(fake_pg: str) -> None:
    gm = backward_like_graph(6, fake_pg)
    assert _count(gm, *_AGS) == 6
    bucketing_pass = OverlapBucketingPass(
        BucketingConfig(max_topo_span=None, bucket_cap_mb=1000.0), cpu=True, reorder=False
    )
    with collect_stats() as stats:
        bucketing_pass(gm.graph)
    assert _count(gm, *_AGS) == 1
    assert _count(gm, _c10d.reduce_scatter_tensor.default) == 1
    assert [s.bucketed for s in stats if s.buckets] == [6, 6]
    assert not ap_bucketing.is_installed()
    gm.graph.lint()


@pytest.mark.parametrize("reorder", [False, True])
@pytest.mark.parametrize("mode", ["default", "custom_ops"])
def test_a_backward_without_all_gathers_buckets_its_reduce_scatters(
    fake_pg: str, mode: str, reorder: bool
) -> None:
    """The ordinary backward (gathered weights saved by the forward) only reduce-scatters;
    torch's own group detection finds no FSDP group there and leaves one collective per
    parameter. Under ap-bucketing they are bucketed like a re-gathering backward's."""
    gm = backward_like_graph(6, fake_pg, regather=False)
    assert _count(gm, *_AGS) == 0
    assert _count(gm, _c10d.reduce_scatter_tensor.default) == 6
    config = BucketingConfig(max_topo_span=None, bucket_cap_mb=1000.0, bucket_mode=mode)
    bucketing_pass = OverlapBucketingPass(config, cpu=True, reorder=reorder)
    with collect_stats() as stats:
        bucketing_pass(gm.graph)
    gm.graph.lint()
    assert _count(gm, _c10d.reduce_scatter_tensor.default) == 1
    assert [s.bucketed for s in stats if s.buckets] == [6]
    assert bucketing_pass.reports[-1]["collectives"] == {
        "all_gather": (0, 0),
        "reduce_scatter": (6, 1),
        "all_reduce": (0, 0),
    }


@pytest.mark.parametrize("reorder", [False, True])
@pytest.mark.parametrize("mode", ["default", "custom_ops"])
def test_bucket_mode_reaches_torchs_bucketing(fake_pg: str, mode: str, reorder: bool) -> None:
    """``BucketingConfig.bucket_mode`` decides torch's bucket form, with and without the
    scheduler: ``custom_ops`` packs each bucket in one opaque op, ``default`` in copies."""
    gm = backward_like_graph(6, fake_pg)
    config = BucketingConfig(max_topo_span=None, bucket_cap_mb=1000.0, bucket_mode=mode)
    OverlapBucketingPass(config, cpu=True, reorder=reorder)(gm.graph)
    gm.graph.lint()
    packs = _count(gm, torch.ops.bucketing._pre_bucket_all_gather.default) + _count(
        gm, torch.ops.bucketing._pre_bucket_reduce_scatter.default
    )
    assert _count(gm, *_AGS) == 1
    assert packs == (2 if mode == "custom_ops" else 0)


def test_span_cap_bounds_compute_between_reduce_scatters(fake_pg: str) -> None:
    results = {}
    for span in (None, 40):
        gm = backward_like_graph(8, fake_pg)
        assert max_consec_compute_between_rs(gm) == 2
        bucketing_pass = OverlapBucketingPass(
            BucketingConfig(max_topo_span=span, bucket_cap_mb=1000.0), cpu=True
        )
        bucketing_pass(gm.graph)
        gm.graph.lint()
        results[span] = max_consec_compute_between_rs(gm)
        assert bucketing_pass.reports[-1]["max_consec_compute_between_rs"] == (2, results[span])
    # One bucket of all reduce-scatters lets every matmul run first; the cap keeps runs short.
    assert results[None] == 16
    assert results[40] < results[None]


def test_pass_refuses_a_graph_without_module() -> None:
    with pytest.raises(ValueError, match="GraphModule"):
        OverlapBucketingPass(cpu=True)(fx.Graph())


def test_config_patches_carry_the_pass_and_disable_builtin_scheduling() -> None:
    cfg = BucketingConfig(max_topo_span=123, max_compute_pre_fetch=7, bucket_cap_mb=32.0)
    patches = overlap_config_patches(cfg, cpu=True)
    bucketing_pass = patches["post_grad_custom_post_pass"]
    assert isinstance(bucketing_pass, OverlapBucketingPass)
    assert bucketing_pass.config is cfg
    assert patches["aten_distributed_optimizations.enable_overlap_scheduling"] is False
    kwargs = bucketing_pass.schedule_kwargs()
    assert kwargs["max_compute_pre_fetch"] == 7
    assert kwargs["pre_bucketing_fsdp_collectives_bucket_cap_mb"] == 32.0
    assert kwargs["compute_estimator"] == "analytical"
    assert kwargs["enable_fusion_regions"] is False
    assert kwargs["custom_runtime_estimation"] is cpu_runtime_estimation
    with torch._inductor.config.patch(patches):  # valid Inductor config keys
        assert torch._inductor.config.post_grad_custom_post_pass is bucketing_pass


def test_cpu_estimators_are_scoped_and_restored_exactly() -> None:
    original = getattr(overlap_scheduling, ESTIMATOR)
    with cpu_overlap_estimators():
        with cpu_overlap_estimators():  # nestable
            inside = getattr(overlap_scheduling, ESTIMATOR)
        assert getattr(overlap_scheduling, ESTIMATOR) is inside
    assert getattr(overlap_scheduling, ESTIMATOR) is original
    # replaced on every version: 2.13/2.14 raise without a GPU, 2.15 warns twice per node
    assert inside is not original
    with cpu_overlap_estimators(enabled=False):
        assert getattr(overlap_scheduling, ESTIMATOR) is original


def test_a_refusing_pass_leaves_the_graph_untouched(fake_pg: str) -> None:
    gm = backward_like_graph(4, fake_pg)
    rs = gm.graph.find_nodes(op="call_function", target=_c10d.reduce_scatter_tensor.default)[-1]
    del rs.meta["val"]  # all-gathers would merge before torch ever sized this one
    before = gm.graph.python_code("self").src
    with pytest.raises(ap_bucketing.MissingValueError, match=rs.name):
        OverlapBucketingPass(cpu=True, reorder=False)(gm.graph)
    assert gm.graph.python_code("self").src == before
    assert not ap_bucketing.is_installed()


def test_ddp_gradient_all_reduces_are_bucketed(fake_pg: str) -> None:
    """DDP's backward all-reduces each gradient straight to the output: the all-reduces make
    the group (no all-gather, no reduce-scatter) and are bucketed under the same rules."""
    gm = backward_like_graph(6, fake_pg, regather=False, all_reduce=True)
    assert _count(gm, _c10d.all_reduce.default) == 6
    bucketing_pass = OverlapBucketingPass(
        BucketingConfig(max_topo_span=None, bucket_cap_mb=1000.0), cpu=True, reorder=True
    )
    bucketing_pass(gm.graph)
    gm.graph.lint()
    assert bucketing_pass.reports[-1]["collectives"]["all_reduce"] == (6, 1)


@pytest.mark.parametrize("mode", ["default", "custom_ops"])
def test_reduce_scatter_waits_with_alias_users_are_bucketed(fake_pg: str, mode: str) -> None:
    """torchtitan#4052's shape: each gradient leaves through ``aten.alias(wait_tensor(rs))``.
    The alias is a single-input op, so the reduce-scatters are still FSDP gradients; they are
    bucketed and every output still reads its own member through its alias."""
    gm = backward_like_graph(4, fake_pg, regather=False)
    wait = torch.ops._c10d_functional.wait_tensor.default
    output = gm.graph.output_node()
    for old in [a for a in output.args[0] if a.target is wait]:  # type: ignore[union-attr]
        with gm.graph.inserting_after(old):
            alias = gm.graph.call_function(torch.ops.aten.alias.default, (old,))
        alias.meta["val"] = old.meta["val"]
        output.replace_input_with(old, alias)
    gm.recompile()
    config = BucketingConfig(max_topo_span=None, bucket_cap_mb=1000.0, bucket_mode=mode)
    OverlapBucketingPass(config, cpu=True, reorder=True)(gm.graph)
    gm.graph.lint()
    assert _count(gm, _c10d.reduce_scatter_tensor.default) == 1
    outs = gm.graph.output_node().args[0]
    aliases = [a for a in outs if a.target is torch.ops.aten.alias.default]  # type: ignore[union-attr]
    assert len(aliases) == 4 and len({a.args[0] for a in aliases}) == 4


@pytest.mark.parametrize("mode", ["default", "custom_ops"])
def test_a_reduce_scatter_with_two_waits_is_bucketed(fake_pg: str, mode: str) -> None:
    """CSE merges two identical reduce-scatters into one node that keeps both waits (timm's
    ResNet-10t with Inductor's decompositions: two BatchNorm bias gradients summed from one
    tensor). torch's bucketers assert one user per collective; the pass merges the later wait
    into the first, so both gradients read the one bucketed member."""
    gm = backward_like_graph(4, fake_pg, regather=False)
    wait = _c10d.wait_tensor.default
    output = gm.graph.output_node()
    first = next(a for a in output.args[0] if a.target is wait)  # type: ignore[union-attr]
    with gm.graph.inserting_after(first):
        twin = gm.graph.call_function(wait, first.args)
    twin.meta["val"] = first.meta["val"]
    output.args = ((*output.args[0], twin),)  # type: ignore[misc]
    gm.recompile()
    config = BucketingConfig(max_topo_span=None, bucket_cap_mb=1000.0, bucket_mode=mode)
    bucketing_pass = OverlapBucketingPass(config, cpu=True, reorder=True)
    bucketing_pass(gm.graph)
    gm.graph.lint()
    assert bucketing_pass.reports[-1]["duplicate_waits_merged"] == [twin.name]
    assert _count(gm, _c10d.reduce_scatter_tensor.default) == 1
    outs = gm.graph.output_node().args[0]
    assert outs[0] is outs[-1]  # type: ignore[index]  # the two gradients: one value


def _transposed_copy(gm: fx.GraphModule, node: fx.Node) -> fx.Node:
    """``t(clone(t(node)))``: the same values as ``node`` with transposed (non-contiguous)
    strides, as a convolution's or a ``mm(a.t(), b).t()`` weight gradient has."""
    g = gm.graph
    val = node.meta["val"]
    with g.inserting_after(node):
        t1 = g.call_function(torch.ops.aten.t.default, (node,))
    t1.meta["val"] = val.t()
    with g.inserting_after(t1):
        copy = g.call_function(
            torch.ops.aten.clone.default, (t1,), {"memory_format": torch.contiguous_format}
        )
    copy.meta["val"] = val.t().contiguous()
    with g.inserting_after(copy):
        t2 = g.call_function(torch.ops.aten.t.default, (copy,))
    t2.meta["val"] = copy.meta["val"].t()
    return t2


@pytest.mark.parametrize("mode", ["default", "custom_ops"])
def test_a_non_contiguous_reduce_scatter_input_gets_a_contiguous_copy_where_torch_packs_by_view(
    fake_pg: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.11/2.12 pack a bucketed reduce-scatter's members with ``x.view(group_size, -1)``,
    which raises at run time on a non-contiguous gradient (timm's ResNet-10t on 2.11: "view size
    is not compatible with input tensor's size and stride"). Where torch packs that way, the
    pass gives such a member a contiguous copy first; the probe is forced here so the rule runs
    on every torch (on 2.13+ it is a no-op)."""
    import ap_bucketing._compat._fsdp as compat

    monkeypatch.setattr(compat, "_VIEW_PACKING", True)
    gm = backward_like_graph(4, fake_pg, regather=False)
    rs_op = _c10d.reduce_scatter_tensor.default
    first = gm.graph.find_nodes(op="call_function", target=rs_op)[0]
    strided = _transposed_copy(gm, first.args[0])  # type: ignore[arg-type]
    first.replace_input_with(first.args[0], strided)  # type: ignore[arg-type]
    gm.recompile()
    assert not strided.meta["val"].is_contiguous()
    config = BucketingConfig(max_topo_span=None, bucket_cap_mb=1000.0, bucket_mode=mode)
    bucketing_pass = OverlapBucketingPass(config, cpu=True, reorder=True)
    bucketing_pass(gm.graph)
    gm.graph.lint()
    assert bucketing_pass.reports[-1]["contiguous_inputs"] == [first.name]
    assert _count(gm, rs_op) == 1
    # the strided value now reaches the bucket only through its contiguous copy
    (reader,) = strided.users
    assert reader.target is torch.ops.aten.clone.default
    assert reader.kwargs["memory_format"] is torch.contiguous_format
    assert reader.meta["val"].is_contiguous()


def test_contiguous_inputs_leave_the_graph_alone_where_torch_packs_any_strides(
    fake_pg: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ap_bucketing._compat._fsdp as compat

    monkeypatch.setattr(compat, "_VIEW_PACKING", False)
    gm = backward_like_graph(2, fake_pg, regather=False)
    first = gm.graph.find_nodes(op="call_function", target=_c10d.reduce_scatter_tensor.default)[0]
    strided = _transposed_copy(gm, first.args[0])  # type: ignore[arg-type]
    first.replace_input_with(first.args[0], strided)  # type: ignore[arg-type]
    gm.recompile()
    bucketing_pass = OverlapBucketingPass(
        BucketingConfig(max_topo_span=None, bucket_cap_mb=1000.0), cpu=True, reorder=True
    )
    bucketing_pass(gm.graph)
    assert bucketing_pass.reports[-1]["contiguous_inputs"] == []


def test_the_packing_probe_matches_this_torch() -> None:
    """The probe answers what this torch's reduce-scatter packing does with strides: it raises
    on a transposed member exactly when the probe says copies are needed."""
    import torch._inductor.fx_passes.bucketing  # noqa: F401  (registers torch.ops.bucketing)
    from ap_bucketing._compat import bucket_packing_needs_contiguous_inputs

    member = torch.arange(24.0).view(4, 6).t()  # (6, 4), not contiguous
    try:
        torch.ops.bucketing._pre_bucket_reduce_scatter([member], 3)
        raised = False
    except RuntimeError:
        raised = True
    assert bucket_packing_needs_contiguous_inputs() is raised
