"""Save rules on hand-built joint graphs (no process group, no compile)."""

from __future__ import annotations

import logging
import operator
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ap_partitioner
import ap_tags
import pytest
import torch
import torch.fx as fx
from ap_partitioner import (
    PartitionReport,
    ReplayError,
    SaveAllPartitioner,
    _partitioner,
    plan_saves,
)
from torch.utils.checkpoint import CheckpointPolicy

aten = torch.ops.aten
Builder = Any  # the ``joint`` fixture: conftest's Joint builder class
Simple = Callable[..., fx.GraphModule]  # the ``simple`` fixture
MUST_SAVE = CheckpointPolicy.MUST_SAVE
MUST_RECOMPUTE = CheckpointPolicy.MUST_RECOMPUTE
PREFER_RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE


def tag(
    node: fx.Node,
    *,
    replay: bool = False,
    policy: CheckpointPolicy | None = None,
    indices: list[int] | None = None,
) -> None:
    custom = node.meta.setdefault("custom", {})
    if replay:
        custom[ap_tags.MUST_SAVE] = True
    if indices is not None:
        custom[ap_tags.MUST_SAVE_INDICES] = indices
    if policy is not None:
        node.meta["recompute"] = policy


def partition(
    gm: fx.GraphModule,
    num_fwd_outputs: int = 1,
    *,
    joint_inputs: list[Any] | None = None,
    strict: bool = False,
    **kw: Any,
) -> tuple[fx.GraphModule, fx.GraphModule, PartitionReport]:
    reports: list[PartitionReport] = []
    fn = SaveAllPartitioner(strict=strict, on_report=reports.append)
    fw, bw = fn(
        gm, [] if joint_inputs is None else joint_inputs, num_fwd_outputs=num_fwd_outputs, **kw
    )
    assert len(reports) == 1
    return fw, bw, reports[0]


def saved(fw: fx.GraphModule, num_fwd_outputs: int = 1) -> list[str]:
    out = fw.graph.find_nodes(op="output")[0]
    return [n.name for n in out.args[0][num_fwd_outputs:] if isinstance(n, fx.Node)]


def bw_inputs(bw: fx.GraphModule) -> list[str]:
    return [n.name for n in bw.graph.find_nodes(op="placeholder")]


def split_graph(
    joint: Builder,
    parent_tag: Callable[[fx.Node], None],
    *,
    inherit: bool = False,
    extra_parent_user: bool = False,
) -> fx.GraphModule:
    """fwd: split(x) -> 3 getitems -> cos each -> cat; bwd uses cos(getitem 0) and cos(getitem 1)."""
    j = joint()
    x = j.input("primals_1", 6)
    t = j.input("tangents_1", 2)
    sp = j.op(aten.split.Tensor, x, 2, name="split")
    parent_tag(sp)
    items = []
    for i in range(3):
        gi = j.op(operator.getitem, sp, i, name="getitem" if i == 0 else f"getitem_{i}")
        if inherit:  # what a retrace does: the getitem inherits the parent's custom dict
            gi.meta["custom"] = dict(sp.meta.get("custom", {}))
            if "recompute" in sp.meta:
                gi.meta["recompute"] = sp.meta["recompute"]
        items.append(gi)
    c0 = j.op(aten.cos.default, items[0], name="cos")
    c1 = j.op(aten.cos.default, items[1], name="cos_1")
    fwd = j.op(aten.sum.default, j.op(aten.cat.default, items), name="sum_1")
    g0 = j.op(aten.mul.Tensor, c0, t, name="mul")
    g1 = j.op(aten.mul.Tensor, c1, t, name="mul_1")
    grad = j.op(aten.cat.default, [g0, g1, t], name="cat_grad")
    outs: list[fx.Node] = [fwd]
    if extra_parent_user:
        outs.append(j.op(aten.clone.default, j.op(operator.getitem, sp, 2), name="clone"))
        # a non-getitem user of the tuple
        s = j.g.call_function(torch.ops.aten.cat.default, (sp,))
        s.name = "cat_tuple"
        s.meta["val"] = torch.cat(sp.meta["val"])
        outs.append(s)
    return j.module(*outs, grad)


# --------------------------------------------------------------------- plain-node rules


def test_ap_must_save_saved_despite_prefer_recompute(simple: Simple) -> None:
    fw, bw, rep = partition(simple(lambda n: tag(n, replay=True, policy=PREFER_RECOMPUTE)))
    assert "add_tensor" in saved(fw) and "add_tensor" in bw_inputs(bw)
    assert rep.saved_activation_count >= 1 and not rep.fell_back


def test_must_save_policy_honoured(simple: Simple) -> None:
    fw, bw, _ = partition(simple(lambda n: tag(n, policy=MUST_SAVE)))
    assert "add_tensor" in saved(fw) and "add_tensor" in bw_inputs(bw)


def test_untagged_value_is_recomputed_from_saved_primal(simple: Simple) -> None:
    fw, bw, rep = partition(simple(lambda n: None))
    assert saved(fw) == ["primals_1"]
    assert any(n.target is aten.add.Tensor for n in bw.graph.nodes)  # recomputed in backward
    assert rep.saved_activation_count == 0 and rep.saved_input_count == 1


def test_must_recompute_blocks_a_plain_save(simple: Simple) -> None:
    fw, bw, _ = partition(simple(lambda n: tag(n, replay=True, policy=MUST_RECOMPUTE)))
    assert "add_tensor" not in saved(fw) and "add_tensor" not in bw_inputs(bw)


# --------------------------------------------------------------------- multi-output rules


def test_must_recompute_blocks_a_multi_output_save(joint: Builder) -> None:
    gm = split_graph(joint, lambda n: tag(n, replay=True, policy=MUST_RECOMPUTE, indices=[0, 1, 2]))
    fw, _, _ = partition(gm)
    assert not [s for s in saved(fw) if s.startswith("getitem")]


def test_only_indexed_getitems_are_saved(joint: Builder) -> None:
    fw, bw, _ = partition(split_graph(joint, lambda n: tag(n, replay=True, indices=[0])))
    assert "getitem" in saved(fw) and "getitem_1" not in saved(fw)
    assert "split" not in saved(fw)


def test_index_list_still_restricts_when_getitems_inherit_the_parent_tag(joint: Builder) -> None:
    """A retrace copies the parent's ``ap_must_save`` onto its getitems; the list must win."""
    gm = split_graph(joint, lambda n: tag(n, replay=True, indices=[0]), inherit=True)
    fw, _, _ = partition(gm)
    assert "getitem" in saved(fw) and "getitem_1" not in saved(fw)


def test_must_save_overrides_getitem_indices(joint: Builder) -> None:
    fw, _, _ = partition(
        split_graph(joint, lambda n: tag(n, replay=True, policy=MUST_SAVE, indices=[0]))
    )
    assert {"getitem", "getitem_1"} <= set(saved(fw))


def test_tuple_with_a_non_getitem_user_is_never_saved(joint: Builder) -> None:
    gm = split_graph(joint, lambda n: tag(n, replay=True, indices=[0, 1]), extra_parent_user=True)
    fw, bw, _ = partition(gm, num_fwd_outputs=3)
    names = saved(fw, 3)
    assert "split" not in names and "getitem" in names
    for node in bw.graph.find_nodes(op="placeholder"):
        assert not isinstance(node.meta.get("val"), (tuple, list)), node.name


# --------------------------------------------------------------------- sym, opaque, dedup


def _symbolic(hint: int = 4) -> Any:
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    return env.create_symintnode(env.create_symbol(hint, source=ConstantSource("s0")), hint=hint)


def test_sym_rules_save_syms_but_not_assert_only_symbools(joint: Builder) -> None:
    j = joint()
    x = j.input("primals_1", 4)
    size = j.g.call_function(aten.sym_size.int, (x, 0))
    size.meta["val"] = _symbolic()
    asserted = j.g.call_function(operator.ge, (size, 2))
    asserted.meta["val"] = asserted_val = size.meta["val"] >= 2
    assert isinstance(asserted_val, torch.SymBool)
    j.g.call_function(aten._assert_scalar.default, (asserted, "msg"))
    blocked = j.g.call_function(aten.sym_size.int, (x, 0))
    blocked.meta["val"] = _symbolic()
    tag(blocked, replay=True, policy=MUST_RECOMPUTE)
    plan = plan_saves(list(j.g.nodes))
    assert plan.sym_nodes == [size]  # assert-only SymBool and MUST_RECOMPUTE sym excluded


def test_sym_nodes_saved_end_to_end_with_dynamic_shapes() -> None:
    from torch._functorch.aot_autograd import aot_module_simplified

    reports: list[PartitionReport] = []

    def backend(gm: fx.GraphModule, ex: list[Any]) -> Any:
        return aot_module_simplified(
            gm,
            ex,
            fw_compiler=_identity,
            bw_compiler=_identity,
            partition_fn=SaveAllPartitioner(on_report=reports.append),
        )

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() * x.shape[0]).sum()

    torch._dynamo.reset()
    x = torch.randn(5, 3, requires_grad=True)
    torch.compile(f, backend=backend, dynamic=True)(x).backward()
    assert reports and reports[0].sym_count >= 1
    torch.testing.assert_close(x.grad, x.detach().cos() * 5)


def _identity(gm: fx.GraphModule, _ex: Any) -> Any:
    from functorch.compile import make_boxed_func

    return make_boxed_func(gm)


def test_opaque_saved_unless_must_recompute(
    simple: Simple, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._functorch import partitioners

    for policy, expect in ((None, True), (MUST_RECOMPUTE, False)):
        gm = simple(lambda n, p=policy: tag(n, policy=p))  # type: ignore[misc]
        add = next(n for n in gm.graph.nodes if n.name == "add_tensor")
        monkeypatch.setattr(partitioners, "is_opaque_node", lambda n, a=add: n is a, raising=False)
        plan = plan_saves(list(gm.graph.nodes))
        assert (add in plan.opaque_nodes) is expect, policy


def test_saved_lists_are_deduplicated(joint: Builder) -> None:
    """A getitem both selected by its parent's index list and MUST_SAVE itself (as 2.15's
    ``force_save_collectives`` tags leaves) must be saved once."""

    def parent(n: fx.Node) -> None:
        tag(n, replay=True, indices=[0])
        for user in list(n.users):
            user.meta["recompute"] = MUST_SAVE

    gm = split_graph(joint, lambda n: tag(n, replay=True, indices=[0]))
    sp = next(n for n in gm.graph.nodes if n.name == "split")
    next(u for u in sp.users if u.args[1] == 0).meta["recompute"] = MUST_SAVE
    plan = plan_saves(list(gm.graph.nodes))
    assert [n.name for n in plan.values].count("getitem") == 1
    fw, _, _ = partition(gm)
    assert saved(fw).count("getitem") == 1 and len(saved(fw)) == len(set(saved(fw)))


# --------------------------------------------------------------------- call contract


def test_no_backward_delegates_to_default_partition_with_compiler_popped(joint: Builder) -> None:
    j = joint()
    x = j.input("primals_1", 4)
    out = j.op(aten.sin.default, x)
    fw, bw, rep = partition(j.module(out), compiler="inductor", static_lifetime_input_indices=[0])
    assert rep.partitioner == "default"
    assert not [n for n in bw.graph.nodes if n.op == "call_function"]
    assert any(n.target is aten.sin.default for n in fw.graph.nodes)


def test_empty_joint_inputs_and_inductor_kwargs_accepted(simple: Simple) -> None:
    gm = simple(lambda n: tag(n, replay=True))
    fw, _, _ = partition(gm, joint_inputs=[], compiler="inductor", static_lifetime_input_indices=[])
    assert "add_tensor" in saved(fw)


def test_missing_num_fwd_outputs_is_a_clear_error(simple: Simple) -> None:
    with pytest.raises(TypeError, match="num_fwd_outputs"):
        SaveAllPartitioner()(simple(lambda n: None), [])


# --------------------------------------------------------------------- invalid cuts


def _uncuttable(simple: Simple) -> fx.GraphModule:
    """The backward needs the primal itself, but the primal is tagged MUST_RECOMPUTE."""
    gm = simple(lambda n: None)
    tag(next(iter(gm.graph.find_nodes(op="placeholder"))), policy=MUST_RECOMPUTE)
    return gm


def test_invalid_cut_strict_raises_naming_the_value(simple: Simple) -> None:
    with pytest.raises(ReplayError, match="primals_1") as info:
        partition(_uncuttable(simple), strict=True)
    assert info.value.missing == ("primals_1",)
    assert "MUST_RECOMPUTE" in str(info.value)


def test_invalid_cut_falls_back_to_min_cut_with_warning(
    simple: Simple, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="ap_partitioner"):
        fw, bw, rep = partition(_uncuttable(simple))
    assert rep.fell_back and rep.missing_values == ("primals_1",)
    assert rep.fallback_reason is not None and "primals_1" in rep.fallback_reason
    assert any(
        "primals_1" in r.getMessage() and "min-cut" in r.getMessage() for r in caplog.records
    )
    assert "primals_1" in bw_inputs(bw) or "add_tensor" in bw_inputs(bw)  # min-cut's valid cut


def test_extraction_failure_falls_back(simple: Simple, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._functorch import partitioners

    real = partitioners._extract_fwd_bwd_modules
    calls = {"n": 0}

    def failing_once(*a: Any, **k: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise AssertionError("Node add_tensor was invalid, but is output")
        return real(*a, **k)

    monkeypatch.setattr(partitioners, "_extract_fwd_bwd_modules", failing_once)
    _, _, rep = partition(simple(lambda n: tag(n, replay=True)))
    assert rep.fell_back and "add_tensor was invalid" in (rep.fallback_reason or "")
    with pytest.raises(ReplayError, match="extraction"):
        calls["n"] = 0
        partition(simple(lambda n: tag(n, replay=True)), strict=True)


def _rand_graph(joint: Builder, *, replayed: bool) -> fx.GraphModule:
    """fwd: ``mul_fwd = primals_1 * rand_like(primals_1)``; bwd reads the random value."""
    j = joint()
    x = j.input("primals_1", 4)
    t = j.input("tangents_1", 4)
    r = j.g.call_function(aten.rand_like.default, (x,))
    r.name = "rand_like"
    r.meta["val"] = torch.rand(4)
    if replayed:
        tag(r, replay=True)
    m = j.op(aten.mul.Tensor, x, r, name="mul_fwd")
    grad = j.op(aten.mul.Tensor, r, t, name="mul_bw")
    return j.module(m, grad)


def test_unsaved_random_value_is_not_a_valid_cut(joint: Builder) -> None:
    """Recomputing a random op in the backward would draw new numbers."""
    with pytest.raises(ReplayError, match="rand_like"):
        partition(_rand_graph(joint, replayed=False), strict=True)
    fw, _, rep = partition(_rand_graph(joint, replayed=True), strict=True)
    assert "rand_like" in saved(fw) and not rep.fell_back


# --------------------------------------------------------------------- uuid and report


def test_uuid_is_stable_and_changes_with_options_and_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = SaveAllPartitioner().uuid()
    assert isinstance(base, str) and base == SaveAllPartitioner(on_report=print).uuid()
    assert SaveAllPartitioner(strict=True).uuid() != base
    assert SaveAllPartitioner(dce_unused_waits=False).uuid() != base
    assert ap_partitioner.MinCutPartitioner().uuid() != base
    monkeypatch.setattr(_partitioner, "source_hash", lambda: "edited")
    assert SaveAllPartitioner().uuid() != base


def test_source_hash_covers_every_module_of_the_package() -> None:
    """Every loaded ``ap_partitioner`` module is hashed (none is missed after a rename), and
    changing any hashed file's bytes changes the hash."""
    hashed = {p.resolve() for p in _partitioner.source_files()}
    loaded = {
        Path(m.__file__).resolve()
        for name, m in sys.modules.items()
        if (name == "ap_partitioner" or name.startswith("ap_partitioner.")) and m.__file__
    }
    assert loaded and loaded <= hashed
    assert {p.name for p in hashed} >= {"_rules.py", "_partitioner.py", "_compat.py", "_dce.py"}


def test_report_measures_saved_bytes(simple: Simple) -> None:
    fw, _, rep = partition(simple(lambda n: tag(n, replay=True)))
    assert rep.saved_names == tuple(saved(fw))
    assert rep.saved_activation_bytes == 4 * 4  # add_tensor: 4 float32
    assert rep.partition_time_s > 0 and rep.partitioner == "save_all"
    assert '"saved_activation_count": 1' in rep.to_json()


def test_malformed_tags_strict_raise_tag_error_and_leave_the_graph_untouched(
    simple: Simple,
) -> None:
    gm = simple(lambda n: n.meta.setdefault("custom", {}).update({ap_tags.MUST_SAVE: "yes"}))
    before = gm.graph.python_code("self").src
    with pytest.raises(ap_tags.TagError, match="add_tensor"):
        partition(gm, strict=True)
    assert gm.graph.python_code("self").src == before


def test_malformed_tags_fall_back_to_min_cut(simple: Simple) -> None:
    gm = simple(lambda n: n.meta.setdefault("custom", {}).update({ap_tags.MUST_SAVE: "yes"}))
    _, _, rep = partition(gm)
    assert rep.fell_back and "malformed tags" in (rep.fallback_reason or "")
    assert "add_tensor" in (rep.fallback_reason or "")


def test_effectful_op_tagged_must_recompute_is_saved_instead_of_raising(joint: Builder) -> None:
    """torch 2.15's ``force_save_effectful_ops`` raises on MUST_RECOMPUTE (2.13/2.14 skip it and
    build an invalid backward); the prologue re-tags it MUST_SAVE first, on every version."""
    from ap_partitioner._prologue import run_prologue
    from torch._higher_order_ops.effects import with_effects

    j = joint()
    x = j.input("primals_1", 4)
    token = j.input("primals_2", 0)
    t = j.input("tangents_1", 4)
    we = j.g.call_function(with_effects, (token, aten.sin.default, x))
    we.name = "with_effects"
    we.meta["val"] = (torch.empty(0), torch.sin(x.meta["val"]))
    tag(we, policy=MUST_RECOMPUTE)
    new_token = j.op(operator.getitem, we, 0, name="getitem")
    out = j.op(operator.getitem, we, 1, name="getitem_1")
    grad = j.op(aten.mul.Tensor, out, t, name="mul")
    gm = j.module(new_token, out, grad)
    pro = run_prologue(gm)
    assert pro.effectful_retagged == ("with_effects",)
    nodes = {n.name: n for n in pro.module.graph.nodes}
    assert nodes["with_effects"].meta["recompute"] is MUST_SAVE
    plan = plan_saves(list(pro.module.graph.nodes))
    assert "getitem_1" in [n.name for n in plan.values]


def test_report_is_logged_and_traced(
    simple: Simple, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    artifacts: list[tuple[dict[str, Any], str]] = []

    def trace(name: str, *, metadata_fn: Any, payload_fn: Any) -> None:
        assert name == "artifact"
        artifacts.append((metadata_fn(), payload_fn()))

    monkeypatch.setattr(torch._logging, "trace_structured", trace)
    with caplog.at_level(logging.DEBUG, logger="ap_partitioner"):
        _, _, rep = partition(simple(lambda n: tag(n, replay=True)))
    assert artifacts == [({"name": "ap_partition_report", "encoding": "json"}, rep.to_json())]
    assert any("partition report" in r.getMessage() for r in caplog.records)


def test_strict_refusal_leaves_the_joint_graph_untouched(simple: Simple) -> None:
    gm = _uncuttable(simple)
    before = gm.graph.python_code("self").src
    metas = [dict(n.meta) for n in gm.graph.nodes]
    with pytest.raises(ReplayError):
        partition(gm, strict=True)
    assert gm.graph.python_code("self").src == before
    assert [dict(n.meta) for n in gm.graph.nodes] == metas


def test_fallback_drops_the_unsatisfiable_recompute_tag_for_min_cut(simple: Simple) -> None:
    _, bw, rep = partition(_uncuttable(simple))
    assert rep.fell_back and any("primals_1" in note for note in rep.notes)
    bw.graph.lint()


def test_is_all_gather_output_is_the_shared_vocabulary() -> None:
    """One definition: the re-export is ap-tags' predicate itself, not a local copy."""
    assert ap_partitioner.is_all_gather_output is ap_tags.graph.is_all_gather_output


def test_tags_of_another_schema_raise_even_without_strict(simple: Any) -> None:
    """A tag-schema mismatch is a setup error (two ap-tags versions): falling back would hide
    it, and reading the keys would guess their meaning. The caller's graph is untouched."""
    from ap_testing.graphs import snapshot

    def stamp(node: fx.Node) -> None:
        node.meta["custom"] = {"ap_must_save": True, ap_tags.TAG_SCHEMA: 999}

    gm = simple(stamp)
    before = snapshot(gm)
    with pytest.raises(ap_tags.TagSchemaError, match="tag schema 999"):
        SaveAllPartitioner()(gm, [], num_fwd_outputs=1)
    assert snapshot(gm) == before


def test_a_saved_view_of_a_saved_value_is_dropped_and_recomputed() -> None:
    """``relu`` and ``reshape(relu)`` both saved would be two donated buffers sharing one
    storage (the backward may overwrite ``relu`` before reading the view): the view goes, its
    base stays, and the saved storages are the same."""
    from ap_partitioner._rules import SavePlan, without_views_of_saved

    g = fx.Graph()
    x = g.placeholder("x")
    relu = g.call_function(torch.ops.aten.relu.default, (x,))
    view = g.call_function(torch.ops.aten.reshape.default, (relu, [4, 2]))
    view_of_view = g.call_function(torch.ops.aten.t.default, (view,))
    other = g.call_function(torch.ops.aten.neg.default, (x,))
    x_view = g.call_function(torch.ops.aten.view.default, (x, [8]))
    plan = SavePlan([relu, view, view_of_view, other, x_view])
    kept, dropped = without_views_of_saved(plan)
    assert [v.name for v in kept.values] == [relu.name, other.name, x_view.name]
    assert dropped == (view.name, view_of_view.name)
    # a view whose base is not saved stays (x is not in the plan)
    assert without_views_of_saved(SavePlan([x_view, other])) == (SavePlan([x_view, other]), ())


def _backward_all_gather_joint() -> fx.GraphModule:
    """FSDP + TP's rowwise weight gradient, smallest form: the forward computes ``mm`` (saved
    by the first partition), the backward all-gathers it over the TP group and multiplies by
    the tangent. The all-gather reads only a forward value, so ``classify_nodes`` finds it
    unclaimed, and ``force_save_collectives`` tags its wait ``MUST_SAVE``."""
    c10d = torch.ops._c10d_functional
    g = fx.Graph()

    def node(target: Any, args: tuple[Any, ...], val: torch.Tensor, name: str) -> fx.Node:
        n = g.call_function(target, args)
        n.name = name
        n.meta["val"] = val
        return n

    x = g.placeholder("primals_1")
    x.meta["val"] = torch.randn(2, 4)
    w = g.placeholder("primals_2")
    w.meta["val"] = torch.randn(4, 4)
    t = g.placeholder("tangents_1")
    t.meta["val"] = torch.randn(4, 4)
    mm = node(aten.mm.default, (x, w), torch.randn(2, 4), "mm")
    tag(mm, replay=True)
    loss = node(aten.sum.default, (mm,), torch.randn(()), "sum_1")
    ag = node(c10d.all_gather_into_tensor.default, (mm, 2, "tp"), torch.randn(4, 4), "ag")
    wait = node(c10d.wait_tensor.default, (ag,), torch.randn(4, 4), "wait_tensor")
    grad = node(aten.mul.Tensor, (wait, t), torch.randn(4, 4), "mul")
    for n in (ag, wait, grad):
        n.meta["autograd_backward"] = True
    out = g.output((loss, None, grad))
    out.meta["desc"] = [None] * 3
    return fx.GraphModule(torch.nn.Module(), g)


def test_a_backward_collective_reading_only_forward_values_stays_in_the_backward() -> None:
    """The first partition saved ``mm`` and gathered it in the backward; the replay must do
    the same, not move the (force-saved) all-gather into the forward and save its output
    (FSDP + TP on torchtitan's Llama3 saved 4 gathered activations, issue #23 finding 4)."""
    fw, bw, rep = partition(_backward_all_gather_joint())
    assert saved(fw) == ["mm"]
    assert not any("all_gather" in str(n.target) for n in fw.graph.nodes)
    assert any("all_gather" in str(n.target) for n in bw.graph.nodes)
    assert rep.saved_all_gather_count == 0 and not rep.fell_back
