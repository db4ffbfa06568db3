"""Helpers of ap-epchunk's tests that need ap-epchunk itself, handed out as fixtures.

Torch-only models, random models and the joint-step convention live in
``ap_testing.chunking``; what is here traces through ``ap_epchunk.trace_joint``, chunks eagerly
through ``ap_epchunk.EagerChunked`` or builds hinted chunk symbols. Tests import nothing from
this file (pytest runs in importlib mode): they ask for the fixtures, which return the
functions and classes below. The fixtures are session-scoped so hypothesis tests may use them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from ap_epchunk import EagerChunked, mark_chunk_dim, trace_joint
from ap_epchunk._compat import new_hinted_unbacked_symint
from ap_tags import annotate_module_fqns
from ap_testing.chunking import joint_step, module_state
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv


def _trace(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, symbolic: bool, step: Any = None
) -> torch.fx.GraphModule:
    """Joint graph of ``step`` (default ``joint_step(model)``) on copies of ``x`` and ``y``;
    with ``symbolic`` their dim 0 is a hinted unbacked SymInt (the chunk symbol)."""
    xt = x.detach().clone().requires_grad_()
    yt = y.detach().clone()
    if symbolic:
        mark_chunk_dim(xt, 0, hint=x.shape[0])
        mark_chunk_dim(yt, 0, hint=y.shape[0])
    with annotate_module_fqns(model):
        return trace_joint(step or joint_step(model), module_state(model), xt, yt)


def _run_eager_chunked(
    model: nn.Module,
    parent: str,
    child: str | None,
    x: torch.Tensor,
    y: torch.Tensor,
    n: int,
) -> tuple[list[Any], dict[str, torch.Tensor]]:
    """``joint_step``'s outputs computed eagerly with every ``model.<parent>[i](.<child>)``
    wrapped in ``EagerChunked(..., 0, n)``, and the buffers after the step."""
    m = copy.deepcopy(model)
    layers = getattr(m, parent)
    for i in range(len(layers)):
        if child is None:
            layers[i] = EagerChunked(layers[i], 0, n)
        else:
            setattr(layers[i], child, EagerChunked(getattr(layers[i], child), 0, n))
    params = [p for _, p in m.named_parameters()]
    xe = x.detach().clone().requires_grad_()
    loss = F.mse_loss(m(xe), y)
    grads = torch.autograd.grad(loss, [*params, xe])
    buffers = {n.replace(".module", ""): b for n, b in m.named_buffers()}
    return [loss, *grads], buffers


class FakeGraph:
    """Hand-built FX graphs whose values are fake tensors over one ShapeEnv, with hinted
    unbacked chunk symbols (``unbacked(8)``) as ``trace_joint`` makes them."""

    def __init__(self) -> None:
        self.shape_env = ShapeEnv()
        self.fake_mode = FakeTensorMode(shape_env=self.shape_env)
        self.graph = torch.fx.Graph()

    def unbacked(self, hint: int | None) -> torch.SymInt:
        """A chunk symbol with optimization hint ``hint``; ``None``: an unhinted symbol."""
        if hint is None:
            with self.shape_env.ignore_fresh_unbacked_symbols():
                return self.shape_env.create_unbacked_symint()
        return new_hinted_unbacked_symint(self.shape_env, hint)

    def fake(self, *shape: Any) -> torch.Tensor:
        with self.fake_mode:
            return torch.empty(shape)

    def placeholder(self, name: str, val: Any) -> torch.fx.Node:
        node = self.graph.placeholder(name)
        node.meta["val"] = val
        return node

    def op(
        self, target: Any, *args: Any, fqn: str | None = None, backward: bool = False, **kwargs: Any
    ) -> torch.fx.Node:
        """A ``call_function`` node; its ``meta["val"]`` is computed under the fake mode."""
        node = self.graph.call_function(target, args, kwargs)
        vals = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*vals[0], **vals[1])
        if fqn is not None:
            node.meta["custom"] = {"module_fqn": fqn}
        if backward:
            node.meta["autograd_backward"] = True
        return node

    def module(self, *outputs: Any) -> torch.fx.GraphModule:
        self.graph.output(tuple(outputs))
        return torch.fx.GraphModule(torch.nn.Module(), self.graph)


@pytest.fixture(scope="session")
def trace() -> Callable[..., torch.fx.GraphModule]:
    """``trace(model, x, y, *, symbolic, step=None)``: a joint graph via ``trace_joint``."""
    return _trace


@pytest.fixture(scope="session")
def run_eager_chunked() -> Callable[..., tuple[list[Any], dict[str, torch.Tensor]]]:
    """``run_eager_chunked(model, parent, child, x, y, n)``: the eager chunking reference."""
    return _run_eager_chunked


@pytest.fixture(scope="session")
def fake_graph() -> type[FakeGraph]:
    """The :class:`FakeGraph` class (hand-built graphs with fake values and chunk symbols)."""
    return FakeGraph
