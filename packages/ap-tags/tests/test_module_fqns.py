"""annotate_module_fqns: innermost submodule FQN lands in custom["module_fqn"]."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from ap_tags import MODULE_FQN, annotate_module_fqns, module_fqn
from torch.fx.experimental.proxy_tensor import make_fx


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.up(x)) * 3


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x) + self.mlp(x)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def _fqns(gm: torch.fx.GraphModule, target: Any) -> list[str | None]:
    return [
        n.meta.get("custom", {}).get(MODULE_FQN)
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target is target
    ]


def test_make_fx_nodes_carry_innermost_fqn() -> None:
    model = Model()
    with annotate_module_fqns(model):
        gm = make_fx(model)(torch.randn(2, 8))
    aten = torch.ops.aten
    assert _fqns(gm, aten.relu.default) == ["layers.0.mlp", "layers.1.mlp"]
    assert _fqns(gm, aten.addmm.default) == ["layers.0.mlp.up", "layers.1.mlp.up"]
    assert _fqns(gm, aten.sigmoid.default) == ["layers.0", "layers.1"]  # outer restored
    assert _fqns(gm, aten.sum.default) == [None]  # root ops are not annotated by default
    relu_1 = [n for n in gm.graph.nodes if n.target is aten.relu.default][1]
    assert module_fqn(relu_1) == "layers.1.mlp"


def test_forwards_are_restored_even_after_an_error() -> None:
    model = Model()
    with pytest.raises(RuntimeError, match="boom"), annotate_module_fqns(model):
        assert "forward" in model.layers[1].mlp.__dict__
        raise RuntimeError("boom")
    assert all("forward" not in m.__dict__ for m in model.modules())
    gm = make_fx(model)(torch.randn(2, 8))
    assert not any(MODULE_FQN in n.meta.get("custom", {}) for n in gm.graph.nodes)


def test_include_root_and_type_check() -> None:
    model = Model()
    with annotate_module_fqns(model, include_root=True):
        gm = make_fx(model)(torch.randn(2, 8))
    assert _fqns(gm, torch.ops.aten.sum.default) == [""]
    with pytest.raises(TypeError, match="nn.Module"), annotate_module_fqns(object()):  # type: ignore[arg-type]
        pass


def test_dynamo_and_aot_forward_and_backward_nodes() -> None:
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs: dict[str, torch.fx.GraphModule] = {}

    def capture(kind: str) -> Any:
        def compiler(gm: torch.fx.GraphModule, example: Any) -> Any:
            graphs[kind] = gm
            return make_boxed_func(gm.forward)

        return compiler

    def backend(gm: torch.fx.GraphModule, example: Any) -> Any:
        graphs["dynamo"] = gm
        return aot_module_simplified(
            gm, example, fw_compiler=capture("fw"), bw_compiler=capture("bw")
        )

    model = Model()
    torch._dynamo.reset()
    with annotate_module_fqns(model):
        loss = torch.compile(model, backend=backend, fullgraph=True)(torch.randn(2, 8))
    loss.backward()
    aten = torch.ops.aten
    assert _fqns(graphs["fw"], aten.relu.default) == ["layers.0.mlp", "layers.1.mlp"]
    assert _fqns(graphs["fw"], aten.sigmoid.default) == ["layers.0", "layers.1"]
    # backward ops inherit the FQN of the forward op they differentiate
    assert sorted(_fqns(graphs["bw"], aten.threshold_backward.default)) == [  # type: ignore[type-var]
        "layers.0.mlp",
        "layers.1.mlp",
    ]
    assert set(_fqns(graphs["bw"], aten.mm.default)) == {"layers.0.mlp.up", "layers.1.mlp.up"}
    dyn_relu = [n for n in graphs["dynamo"].graph.nodes if "relu" in n.name]
    assert [module_fqn(n) for n in dyn_relu] == ["layers.0.mlp", "layers.1.mlp"]


def test_joint_export_backward_nodes_carry_forward_fqn() -> None:
    import contextlib

    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

    model = Model()
    with contextlib.ExitStack() as stack:
        with annotate_module_fqns(model):
            jd = aot_export_joint_with_descriptors(stack, model, (torch.randn(2, 8),))
        nodes = list(jd.graph_module.graph.nodes)
    bw = [n for n in nodes if n.meta.get("partitioner_tag") == "is_backward"]
    thresholds = [n for n in bw if n.target is torch.ops.aten.threshold_backward.default]
    assert [module_fqn(n) for n in thresholds] == ["layers.1.mlp", "layers.0.mlp"]
    fw_relu = [n for n in nodes if n.target is torch.ops.aten.relu.default]
    assert [module_fqn(n) for n in fw_relu] == ["layers.0.mlp", "layers.1.mlp"]
