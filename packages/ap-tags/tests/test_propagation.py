"""Tags survive a retrace of graphs run by preserve_meta_compiler (make_fx and AOTAutograd)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed._functional_collectives  # noqa: F401
import torch.nn as nn
from ap_tags import (
    FSDP_AC_GRAPH_ID,
    InterpretedGraph,
    is_must_save,
    mark_fsdp_all_gather_recomputation,
    mark_must_save,
    preserve_meta_compiler,
    recompute_policy,
)
from ap_testing.distributed import fake_world
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy

c10d = torch.ops._c10d_functional
MUST_RECOMPUTE = CheckpointPolicy.MUST_RECOMPUTE


def _fsdp_fn(group_name: str) -> Any:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(w.to(torch.float32), 8, group_name))
        return torch.relu(x @ gathered.t()).sum(dim=1)

    return f


def _first_graph() -> torch.fx.GraphModule:
    """make_fx of the FSDP toy (fake tensors: no process group is needed to trace)."""
    x, w = torch.randn(4, 16), torch.randn(4, 16, dtype=torch.float64)
    return make_fx(_fsdp_fn("0"), tracing_mode="fake")(x, w)


def _retrace(run: InterpretedGraph) -> torch.fx.GraphModule:
    x, w = torch.randn(4, 16), torch.randn(4, 16, dtype=torch.float64)
    return make_fx(lambda a, b: run([a, b]), tracing_mode="fake")(x, w)


def _by_target(gm: torch.fx.GraphModule) -> dict[str, torch.fx.Node]:
    return {str(n.target): n for n in gm.graph.nodes if n.op == "call_function"}


def test_make_fx_retrace_keeps_custom_recompute_and_ac_graph_id() -> None:
    first = _first_graph()
    mark_fsdp_all_gather_recomputation(first)
    relu = _by_target(first)["aten.relu.default"]
    mark_must_save(relu)
    relu.meta["custom"]["module_fqn"] = "layers.1.mlp"

    second = _retrace(preserve_meta_compiler()(first, []))
    nodes = _by_target(second)
    for target in (
        "aten._to_copy.default",
        "_c10d_functional.all_gather_into_tensor.default",
        "_c10d_functional.wait_tensor.default",
        "aten.t.default",
    ):
        assert recompute_policy(nodes[target]) is MUST_RECOMPUTE, target
        assert nodes[target].meta["ac_graph_id"] == FSDP_AC_GRAPH_ID, target
    new_relu = nodes["aten.relu.default"]
    assert is_must_save(new_relu)
    assert new_relu.meta["custom"]["module_fqn"] == "layers.1.mlp"
    assert recompute_policy(nodes["aten.mm.default"]) is None
    assert not is_must_save(nodes["aten.mm.default"])


def test_without_the_compiler_nothing_survives() -> None:
    """Control: plain interpretation (no preserve_node_meta) loses every tag."""
    first = _first_graph()
    mark_fsdp_all_gather_recomputation(first)

    def plain(args: list[Any]) -> Any:
        return torch.fx.Interpreter(first).boxed_run(args)

    second = _retrace(plain)  # type: ignore[arg-type]
    assert not any("recompute" in n.meta for n in second.graph.nodes)


def test_compiler_is_boxed_and_computes_the_graph() -> None:
    gm = make_fx(lambda a: (torch.relu(a) * 2,))(torch.randn(3))
    run = preserve_meta_compiler()(gm, [])
    assert run._boxed_call is True
    x = torch.randn(3)
    args = [x]
    (out,) = run(args)
    assert args == []  # the boxed convention: the callee clears the argument list
    torch.testing.assert_close(out, torch.relu(x) * 2)
    assert run.saved_report is None


def test_tag_forward_uses_explicit_num_fwd_outputs() -> None:
    gm = make_fx(lambda a: (torch.sin(a).sum(), torch.cos(a)))(torch.randn(3))
    run = preserve_meta_compiler(tag_forward=True, num_fwd_outputs=1)(gm, [])
    assert run.saved_report is not None and run.saved_report.source == "argument"
    tagged = {n.target for n in gm.graph.nodes if is_must_save(n)}
    assert tagged == {torch.ops.aten.cos.default}


def test_compiler_option_type_is_checked() -> None:
    with pytest.raises(TypeError, match="tag_forward"):
        preserve_meta_compiler(tag_forward="yes")  # type: ignore[arg-type]


class _Sharded(nn.Module):
    def __init__(self, group_name: str) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 16, dtype=torch.float64))
        self.fn = _fsdp_fn(group_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.w)  # type: ignore[no-any-return]


def test_two_stage_aot_run_with_fake_process_group_keeps_tags() -> None:
    """First compile: FSDP tagging on the joint + preserve_meta_compiler(tag_forward=True).
    Second compile (torch.compile -> AOTAutograd) retraces it; its joint graph keeps the
    first stage's ``custom`` save tags and the FSDP chain's recompute/ac_graph_id."""
    from torch._functorch.aot_autograd import (
        aot_compile_joint_with_descriptors,
        aot_export_joint_with_descriptors,
        aot_module_simplified,
    )
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    with fake_world() as group_name:
        model = _Sharded(group_name)
        x = torch.randn(4, 16, requires_grad=True)
        reports: dict[str, Any] = {}

        def fw_compiler(gm: torch.fx.GraphModule, example: Any) -> InterpretedGraph:
            run = preserve_meta_compiler(tag_forward=True)(gm, example)
            reports["saved"] = run.saved_report
            return run

        with contextlib.ExitStack() as stack:
            jd = aot_export_joint_with_descriptors(stack, model, (x,))
            reports["fsdp"] = mark_fsdp_all_gather_recomputation(jd.graph_module.graph)
            first = aot_compile_joint_with_descriptors(
                jd, fw_compiler=fw_compiler, bw_compiler=preserve_meta_compiler()
            )
        assert reports["fsdp"].chains_found == 1
        saved = reports["saved"]
        assert saved.source == "descriptors" and saved.num_fwd_outputs == 1
        assert saved.tagged  # some activation was saved, and only saved values were tagged

        class Parallel(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.w = model.w

            def forward(self, inp: torch.Tensor) -> Any:
                return first(self.w, inp)

        joints: list[torch.fx.GraphModule] = []

        def partition(joint: torch.fx.GraphModule, joint_inputs: Any, **kw: Any) -> Any:
            joints.append(joint)
            return min_cut_rematerialization_partition(joint, joint_inputs, **kw)

        def backend(gm: torch.fx.GraphModule, example: Any) -> Any:
            nop = preserve_meta_compiler()
            return aot_module_simplified(
                gm, example, fw_compiler=nop, bw_compiler=nop, partition_fn=partition
            )

        torch._dynamo.reset()
        out = torch.compile(Parallel(), backend=backend, fullgraph=True)(x)
        out.sum().backward()  # structure only: fake-PG data is garbage

    (joint,) = joints
    by_name = {n.name: n for n in joint.graph.nodes}
    fwd = [n for n in joint.graph.nodes if n.meta.get("partitioner_tag") == "is_forward"]
    chain_targets = {
        torch.ops.aten._to_copy.default,
        c10d.all_gather_into_tensor.default,
        c10d.wait_tensor.default,
    }
    chain = [n for n in fwd if n.target in chain_targets]
    assert {n.target for n in chain} == chain_targets
    for n in chain:
        assert recompute_policy(n) is MUST_RECOMPUTE, n.name
        assert n.meta["ac_graph_id"] == FSDP_AC_GRAPH_ID, n.name
    saved_now = {n.name for n in fwd if is_must_save(n)}
    assert saved_now and saved_now <= set(by_name)
    assert not any(is_must_save(n) for n in fwd if n.target is torch.ops.aten.sum.dim_IntList)
