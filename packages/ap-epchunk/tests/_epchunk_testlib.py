"""Models, tracing and comparison helpers shared by ap-epchunk's tests."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from ap_epchunk import EagerChunked, mark_chunk_dim, trace_joint
from ap_tags import annotate_module_fqns
from torch import nn


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Stack(nn.Module):
    def __init__(self, d: int, n_layers: int, block: Callable[[int], nn.Module] = MLP) -> None:
        super().__init__()
        self.layers = nn.ModuleList([block(d) for _ in range(n_layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class MoE(nn.Module):
    """Router, top-k gating, dense per-expert compute and a tokens_per_expert buffer."""

    def __init__(self, d: int, n_experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.k = k
        self.router = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList([MLP(d) for _ in range(n_experts)])
        self.register_buffer("tokens_per_expert", torch.zeros(n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x), dim=-1)
        gates, idx = torch.topk(probs, self.k, dim=-1)
        experts = torch.arange(len(self.experts), device=x.device)
        onehot = (idx.unsqueeze(-1) == experts).to(x.dtype)  # [T, k, E]
        self.tokens_per_expert.add_(onehot.sum(dim=(0, 1)))
        weights = (gates.unsqueeze(-1) * onehot).sum(dim=1)  # [T, E]
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + weights[:, e : e + 1] * expert(x)
        return out


class MoEBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.moe = MoE(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the residual joins *outside* the MoE input: autograd accumulates every use of a
        # tensor in one chain, so a residual on the MoE input itself would interleave
        # full-graph and per-chunk gradient terms and break bitwise equality with eager chunking
        return x + self.moe(self.proj(x))


def make_step(model: nn.Module, loss_fn: Callable[..., torch.Tensor] = F.mse_loss) -> Any:
    def step(state: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> list[Any]:
        out = torch.func.functional_call(model, state, (x,))
        loss = loss_fn(out, y)
        params = [v for v in state.values() if v.requires_grad]
        grads = torch.autograd.grad(loss, [*params, x])
        return [loss, *grads]

    return step


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    state = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    state.update({n: b.detach().clone() for n, b in model.named_buffers()})
    return state


def trace(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, symbolic: bool, step: Any = None
) -> torch.fx.GraphModule:
    """Joint graph of ``step``; with ``symbolic`` the token dim 0 is a hinted unbacked SymInt."""
    xt = x.detach().clone().requires_grad_()
    yt = y.detach().clone()
    if symbolic:
        mark_chunk_dim(xt, 0, hint=x.shape[0])
        mark_chunk_dim(yt, 0, hint=y.shape[0])
    with annotate_module_fqns(model):
        return trace_joint(step or make_step(model), state_of(model), xt, yt)


def run_graph(
    gm: torch.fx.GraphModule, model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> tuple[list[Any], dict[str, torch.Tensor]]:
    """Outputs of the joint graph and the (possibly mutated) buffers it ran with."""
    state = state_of(model)
    out = gm(state, x.detach().clone().requires_grad_(), y.clone())
    return list(out), {n: b for n, b in state.items() if not b.requires_grad}


def run_eager_chunked(
    model: nn.Module,
    pattern_parent: str,
    child: str | None,
    x: torch.Tensor,
    y: torch.Tensor,
    n: int,
) -> tuple[list[Any], dict[str, torch.Tensor]]:
    """The same step with every ``model.<parent>[i](.<child>)`` wrapped in EagerChunked."""
    m = copy.deepcopy(model)
    layers = getattr(m, pattern_parent)
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


def graph_snapshot(gm: torch.fx.GraphModule) -> tuple[str, list[Any]]:
    """Code plus every node's metas, for 'the graph is exactly unchanged' checks."""
    metas = []
    for node in gm.graph.nodes:
        meta = {k: (repr(v) if k != "custom" else dict(v)) for k, v in node.meta.items()}
        metas.append((node.name, node.op, str(node.target), repr(node.args), meta))
    return gm.code, metas


class GraphBuilder:
    """Hand-built FX graphs with fake values over one ShapeEnv (for unit tests)."""

    def __init__(self) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        self.shape_env = ShapeEnv()
        self.fake_mode = FakeTensorMode(shape_env=self.shape_env)
        self.graph = torch.fx.Graph()

    def unbacked(self, hint: int | None) -> torch.SymInt:
        from ap_epchunk._compat import new_hinted_unbacked_symint

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
