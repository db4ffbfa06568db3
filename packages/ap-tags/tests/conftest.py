"""Hand-built FX graphs with functional-collective targets (never executed; no process group)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed._functional_collectives  # noqa: F401  (registers _c10d_functional)
import torch.fx

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional
AG = c10d.all_gather_into_tensor.default
WAIT = c10d.wait_tensor.default


class Builder:
    """Tiny helper: nodes named explicitly, ``meta['val']`` set so sizes are known."""

    def __init__(self) -> None:
        self.g = torch.fx.Graph()

    def ph(self, name: str, shape: tuple[int, ...] = (4, 8)) -> torch.fx.Node:
        n = self.g.placeholder(name)
        n.meta["val"] = torch.empty(shape)
        return n

    def op(
        self, target: object, args: tuple[object, ...], name: str, shape: tuple[int, ...] = (4, 8)
    ) -> torch.fx.Node:
        n = self.g.call_function(target, args, name=name)  # type: ignore[arg-type]
        n.meta["val"] = torch.empty(shape)
        return n

    def all_gather(self, inp: torch.fx.Node, name: str = "ag") -> torch.fx.Node:
        return self.op(AG, (inp, 4, "0"), name, (16, 8))

    def wait(self, inp: torch.fx.Node, name: str = "wait") -> torch.fx.Node:
        return self.op(WAIT, (inp,), name, (16, 8))

    def done(self, *outs: torch.fx.Node) -> torch.fx.GraphModule:
        self.g.output(tuple(outs))
        return torch.fx.GraphModule(torch.nn.Module(), self.g)


@pytest.fixture
def build() -> type[Builder]:
    """The ``Builder`` class (fixtures are how importlib-mode tests share helpers)."""
    return Builder
