"""Hand-built FX graphs and a comparable snapshot of a graph (code + every node's meta).

``snapshot`` is how every "a refusal leaves the graph exactly as it was" test compares before
and after: the generated code, plus each node's meta reduced to a comparable form (tensors by
shape and dtype, unknown objects by identity).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed._functional_collectives  # noqa: F401  (registers _c10d_functional)
import torch.fx

__all__ = ["AG", "WAIT", "Builder", "fakeify", "meta_form", "snapshot"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
AG = c10d.all_gather_into_tensor.default
WAIT = c10d.wait_tensor.default


def meta_form(value: Any) -> Any:
    """A comparable stand-in for a meta value (tensors by shape/dtype, objects by identity)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(meta_form(v) for v in value))
    if isinstance(value, dict):
        return {k: meta_form(v) for k, v in value.items()}
    if isinstance(value, str | int | float | bool | type(None)) or hasattr(value, "name"):
        return copy.deepcopy(value)
    return ("object", id(value))


def snapshot(gm: torch.fx.GraphModule) -> tuple[str, list[tuple[str, Any]]]:
    """Graph code plus a comparable form of every node's meta."""
    return gm.graph.python_code("self").src, [
        (n.name, meta_form(dict(n.meta))) for n in gm.graph.nodes
    ]


def fakeify(gm: torch.fx.GraphModule) -> None:
    """Replace every tensor ``meta["val"]`` (also inside tuples) by a CPU fake tensor of the same
    shape and dtype: torch's bucket merging and scheduling trace through fake mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()

    def fake(val: Any) -> Any:
        if isinstance(val, torch.Tensor):
            return mode.from_tensor(torch.empty(val.shape, dtype=val.dtype))
        if isinstance(val, tuple):
            return tuple(fake(v) for v in val)
        return val

    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["val"] = fake(node.meta["val"])


class Builder:
    """Tiny helper for hand-built graphs: nodes named explicitly, ``meta['val']`` set so sizes
    are known. Never executed (values are empty tensors)."""

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
