"""Hand-built joint graphs shared by ap-partitioner's tests (fixtures ``joint`` and ``simple``).

The workspace-wide scaffolding (fake process group, random joints, snapshots, toy models, the
two compilations) comes from ap-testing; what is here is the partitioner's own: a joint-graph
builder whose nodes carry real CPU values as ``meta["val"]`` (computed from their inputs, so
multi-output ops get tuple values), and the smallest joint with a backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx

aten = torch.ops.aten


class Joint:
    """A tiny joint-graph builder: nodes carry real CPU values as ``meta["val"]``."""

    def __init__(self) -> None:
        self.g = fx.Graph()

    def input(self, name: str, *shape: int) -> fx.Node:
        node = self.g.placeholder(name)
        node.meta["val"] = torch.randn(*shape)
        return node

    def op(self, target: Callable[..., Any], *args: Any, name: str | None = None) -> fx.Node:
        node = self.g.call_function(target, args)
        if name is not None:
            node.name = name

        def val(a: Any) -> Any:
            if isinstance(a, fx.Node):
                return a.meta["val"]
            return [val(x) for x in a] if isinstance(a, list) else a

        node.meta["val"] = target(*[val(a) for a in args])
        return node

    def module(self, *outputs: fx.Node | None) -> fx.GraphModule:
        out = self.g.output(tuple(outputs))
        out.meta["desc"] = [None] * len(outputs)
        return fx.GraphModule(torch.nn.Module(), self.g)


def simple_joint(meta_tagger: Callable[[fx.Node], None] = lambda n: None) -> fx.GraphModule:
    """fwd: ``add_tensor = primals_1 + primals_1`` (the user output); bwd:
    ``mul(sin(add_tensor), tangents_1)``, so the backward needs ``add_tensor`` (saved or
    recomputed from the primal). ``meta_tagger`` may tag ``add_tensor``."""
    j = Joint()
    x = j.input("primals_1", 4)
    t = j.input("tangents_1", 4)
    add = j.op(aten.add.Tensor, x, x, name="add_tensor")
    meta_tagger(add)
    sin = j.op(aten.sin.default, add, name="sin")
    grad = j.op(aten.mul.Tensor, sin, t, name="mul")
    return j.module(add, grad)


@pytest.fixture
def joint() -> type[Joint]:
    """The :class:`Joint` builder class."""
    return Joint


@pytest.fixture
def simple() -> Callable[..., fx.GraphModule]:
    """:func:`simple_joint`: a fresh smallest joint per call."""
    return simple_joint
