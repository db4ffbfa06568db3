"""mark_ac_stages / ac_joint_pass: PREFER_RECOMPUTE by default, MUST_SAVE at stage frontiers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ap_tags import (
    FSDP_AC_GRAPH_ID,
    AcJointPass,
    ac_joint_pass,
    mark_ac_stages,
    recompute_policy,
    set_recompute,
)
from torch.utils.checkpoint import CheckpointPolicy

aten = torch.ops.aten
P = CheckpointPolicy
GIB = 1 << 30
NODE_BYTES = 4 * 8 * 4  # every hand-built value is a float32 [4, 8]


def _joint(build: Any, n_fwd: int = 4) -> tuple[torch.fx.GraphModule, dict[str, torch.fx.Node]]:
    """x -> a0 -> a1 -> ... (relu chain) -> loss; backward multiplies the tangent by every a_i.

    Also: ``side`` is a forward-only value the backward never needs, and ``split`` +
    ``getitem`` feed the backward too.
    """
    b = build()
    x = b.ph("primals_1")
    tangent = b.ph("tangents_1")
    cur = x
    acts = []
    for i in range(n_fwd):
        cur = b.op(aten.relu.default, (cur,), f"a{i}")
        acts.append(cur)
    side = b.op(aten.sin.default, (x,), "side")
    split = b.op(aten.split.Tensor, (cur, 2), "split")
    split.meta["val"] = (torch.empty(2, 8), torch.empty(2, 8))
    item = b.op(__import__("operator").getitem, (split, 0), "item")
    loss = b.op(aten.sum.default, (cur,), "loss")
    grad = tangent
    for i, act in enumerate(reversed(acts)):
        grad = b.op(aten.mul.Tensor, (grad, act), f"g{i}")
    grad = b.op(aten.add.Tensor, (grad, item), "g_item")
    gm = b.done(loss, side, grad)
    return gm, {n.name: n for n in gm.graph.nodes}


def _policies(nodes: dict[str, torch.fx.Node]) -> dict[str, Any]:
    return {k: recompute_policy(v) for k, v in nodes.items() if "recompute" in v.meta}


def test_recomputable_forward_nodes_get_prefer_recompute(build: Any) -> None:
    gm, n = _joint(build)
    report = mark_ac_stages(gm, stage_size_gib=1.0)  # one stage: everything fits
    tagged = _policies(n)
    # forward values the backward needs; not placeholders, getitems, forward-only or bw nodes
    assert set(tagged) == {"a0", "a1", "a2", "a3", "split"} | set(report.must_save)
    assert all(n[k].meta["ac_graph_id"] == FSDP_AC_GRAPH_ID for k in tagged)
    assert "item" not in tagged and "side" not in tagged and "loss" not in tagged
    assert not any(k.startswith("g") or k.startswith(("primals", "tangents")) for k in tagged)
    assert report.stages == 1
    assert report.total_bytes == 5 * NODE_BYTES  # a0..a3 + item (the split tuple counts 0)


def test_stage_frontiers_are_saved(build: Any) -> None:
    gm, n = _joint(build, n_fwd=6)
    report = mark_ac_stages(gm, stage_size_gib=2 * NODE_BYTES / GIB)
    # stages of two activations: [a0 a1] [a2 a3] [a4 a5] [split item]; in a relu chain the
    # frontier at any point is the one live activation, and ties go to the stage's end.
    assert report.stages == 4
    assert report.must_save == ("a1", "a3", "a5")
    pol = _policies(n)
    assert pol["a1"] is P.MUST_SAVE and pol["a3"] is P.MUST_SAVE and pol["a5"] is P.MUST_SAVE
    assert pol["a0"] is P.PREFER_RECOMPUTE and pol["a4"] is P.PREFER_RECOMPUTE
    assert set(report.prefer_recompute) == {"a0", "a2", "a4", "split"}


def test_frontier_prefers_the_least_memory_point(build: Any) -> None:
    b = build()
    x, tangent = b.ph("primals_1"), b.ph("tangents_1")
    wide = b.op(aten.relu.default, (x,), "wide", (64, 8))
    narrow = b.op(aten.sum.dim_IntList, (wide, [0]), "narrow", (8,))
    big = b.op(aten.expand.default, (narrow, [64, 8]), "big", (64, 8))
    tail = b.op(aten.relu.default, (big,), "tail", (64, 8))
    loss = b.op(aten.sum.default, (tail,), "loss", ())
    g0 = b.op(aten.mul.Tensor, (tangent, wide), "g0")
    g1 = b.op(aten.mul.Tensor, (g0, tail), "g1")
    gm = b.done(loss, g1)
    report = mark_ac_stages(gm, stage_size_gib=1.0)
    assert report.must_save == ("narrow",)  # 32 bytes alive there, 2 KiB elsewhere
    assert recompute_policy(wide) is P.PREFER_RECOMPUTE
    assert recompute_policy(big) is P.PREFER_RECOMPUTE


def test_auto_cuts_each_block_at_its_narrow_value(build: Any) -> None:
    """Four blocks ``narrow -> mm (wide) -> relu -> mm (narrow) -> view``, a residual stream:
    "auto" saves every block's narrow output and recomputes the wide values. The old rule,
    sqrt(total GiB) GiB, made one stage of this (and of any forward under 1 GiB): it saved one
    value and recomputed the whole forward from the inputs."""
    b = build()
    x, tangent = b.ph("primals_1", (8, 8)), b.ph("tangents_1", (8, 64))
    w_in, w_out = b.ph("primals_2", (8, 64)), b.ph("primals_3", (64, 8))
    cur, acts = x, []
    for i in range(4):
        wide = b.op(aten.mm.default, (cur, w_in), f"wide{i}", (8, 64))
        act = b.op(aten.relu.default, (wide,), f"act{i}", (8, 64))
        narrow = b.op(aten.mm.default, (act, w_out), f"narrow{i}", (8, 8))
        cur = b.op(aten.view.default, (narrow, [8, 8]), f"view{i}", (8, 8))
        acts.append(act)
    loss = b.op(aten.sum.default, (cur,), "loss", ())
    grad = tangent
    for i, act in enumerate(acts):
        grad = b.op(aten.mul.Tensor, (act, grad), f"g{i}", (8, 64))
    gm = b.done(loss, grad)
    report = mark_ac_stages(gm)
    # per block: wide 2 KiB materialised when recomputed (relu fuses), narrow 256 B alive; a
    # cut at a view is saved as its base (min-cut drops a MUST_SAVE view of a recomputed base)
    assert report.must_save == ("narrow0", "narrow1", "narrow2")
    assert report.stages == 3
    assert all(recompute_policy(a) is P.PREFER_RECOMPUTE for a in acts)


def test_user_annotations_and_forced_recomputes_are_left_alone(build: Any) -> None:
    gm, n = _joint(build, n_fwd=6)
    set_recompute(n["a1"], P.PREFER_RECOMPUTE, ac_graph_id=1)  # a user SAC region
    set_recompute(n["a3"], P.MUST_RECOMPUTE)  # an FSDP chain node
    report = mark_ac_stages(gm, stage_size_gib=NODE_BYTES / GIB)
    assert recompute_policy(n["a1"]) is P.PREFER_RECOMPUTE and n["a1"].meta["ac_graph_id"] == 1
    assert recompute_policy(n["a3"]) is P.MUST_RECOMPUTE
    assert report.user_annotated == ("a1",)
    assert "a1" not in report.must_save and "a3" not in report.must_save
    assert {"a0", "a2", "a4", "a5"} <= set(report.must_save)


def test_collectives_are_not_tagged(build: Any) -> None:
    b = build()
    x, tangent = b.ph("primals_1"), b.ph("tangents_1")
    a = b.op(aten.relu.default, (x,), "a")
    ag = b.all_gather(a)
    wait = b.wait(ag)
    g = b.op(aten.mul.Tensor, (tangent, wait), "g")
    gm = b.done(g)
    mark_ac_stages(gm, stage_size_gib=1.0)
    assert "recompute" not in ag.meta
    assert recompute_policy(a) is not None


@pytest.mark.parametrize(
    ("bad", "exc"),
    [
        (0, ValueError),
        (-1.0, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (True, TypeError),
        ("2", ValueError),
        (None, TypeError),
    ],
)
def test_bad_stage_size_refused_and_graph_unchanged(
    build: Any, bad: object, exc: type[Exception]
) -> None:
    gm, n = _joint(build)
    with pytest.raises(exc, match="stage_size_gib"):
        mark_ac_stages(gm, stage_size_gib=bad)  # type: ignore[arg-type]
    with pytest.raises(exc, match="stage_size_gib"):
        ac_joint_pass(bad)  # type: ignore[arg-type]
    assert _policies(n) == {}


def test_malformed_existing_tag_refused_before_writing(build: Any) -> None:
    from ap_tags import TagError

    gm, n = _joint(build)
    n["a2"].meta["recompute"] = 3
    with pytest.raises(TagError, match="a2"):
        mark_ac_stages(gm)
    assert not any("recompute" in v.meta for k, v in n.items() if k != "a2")


def test_joint_pass_in_aot_autograd_tags_and_keeps_numerics() -> None:
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x @ w)
        h = torch.sin(h @ w)
        return (h @ w).sum()

    joints: list[torch.fx.GraphModule] = []

    def partition(joint: torch.fx.GraphModule, inputs: Any, **kw: Any) -> Any:
        joints.append(joint)
        return min_cut_rematerialization_partition(joint, inputs, **kw)

    the_pass = ac_joint_pass(1e-9)
    assert isinstance(the_pass, AcJointPass)
    nop = lambda gm, _: make_boxed_func(gm.forward)  # noqa: E731
    x, w = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    with torch._functorch.config.patch(joint_custom_pass=the_pass):
        out = aot_function(f, fw_compiler=nop, bw_compiler=nop, partition_fn=partition)(x, w)
    out.backward()
    gx, gw = x.grad, w.grad
    x.grad = w.grad = None
    f(x, w).backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)
    (report,) = the_pass.reports
    assert report.stages >= 2 and report.must_save and report.prefer_recompute
    tagged = {n.name for n in joints[0].graph.nodes if "recompute" in n.meta}
    assert tagged == set(report.must_save) | set(report.prefer_recompute)


def test_a_multi_output_op_is_never_a_saved_frontier(build: Any) -> None:
    """A frontier where a tuple is alive saves its getitems, not the tuple: torch's min-cut
    cannot save a ``MUST_SAVE`` tuple whose getitems it must recompute (the stable argsort ->
    ``sort`` of an expert-parallel MoE failed the min-cut + AC partition that way). Here the
    least-memory point of the first stage is the tuple's own (nothing else alive there)."""
    b = build()
    x, tangent = b.ph("primals_1"), b.ph("tangents_1")
    a = b.op(aten.relu.default, (x,), "a")
    pair = b.op(aten.split.Tensor, (a, 2), "pair")
    pair.meta["val"] = (torch.empty(2, 8), torch.empty(2, 8))
    first = b.op(__import__("operator").getitem, (pair, 0), "first", (2, 8))
    c = b.op(aten.relu.default, (first,), "c", (2, 8))
    loss = b.op(aten.sum.default, (c,), "loss", ())
    g0 = b.op(aten.mul.Tensor, (tangent, c), "g0", (2, 8))
    g1 = b.op(aten.mul.Tensor, (g0, first), "g1", (2, 8))
    gm = b.done(loss, g1)
    report = mark_ac_stages(gm, stage_size_gib=NODE_BYTES / GIB)
    assert "pair" not in report.must_save, report
    assert recompute_policy(pair) is P.PREFER_RECOMPUTE
