"""Token-major toy models, random region models and joint-step helpers for chunking tests.

Every model here maps a ``[T, D]`` (or ``[B, S, D]``) activation to one of the same shape and,
apart from the deliberately token-mixing recipes of :func:`random_models`, computes row ``i`` of
its output from row ``i`` of its input only: that is what lets a chunking pass split a module
region along the token dim. Modules sit under ``layers.<i>`` (``layers.<i>.moe`` for the MoE),
the FQNs chunking patterns select.

The joint-step helpers fix one calling convention, ``step(state, x, y) -> [loss, *grads]``
(parameters and buffers passed as a ``functional_call`` state; gradients of every parameter
and of ``x``), so a traced joint graph and an eager run can be compared output by output.

torch and hypothesis only: tracing (``ap_epchunk.trace_joint``) and eager chunking
(``ap_epchunk.EagerChunked``) belong to the tests of the package that provides them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from hypothesis import settings
from hypothesis import strategies as st
from torch import nn

__all__ = [
    "MLP",
    "OPS",
    "RANDOM_DIM",
    "TOKEN_MIXING",
    "MoE",
    "MoEBlock",
    "RandomBlock",
    "RandomModel",
    "ResidualMLP",
    "Stack",
    "joint_step",
    "module_state",
    "property_settings",
    "random_models",
    "run_joint",
]


def property_settings() -> settings:
    """Hypothesis settings of ap-epchunk's property tests over random joint graphs: 100
    examples a test, the same ones every run (``derandomize``), no deadline.

    Why 100: each example traces and runs a random joint graph (0.2-0.5 s), and 200 took 45-92 s
    a test of a CI run on 2 cores (2026-12-04). ``AP_EPCHUNK_EXAMPLES=200`` (or more) runs a
    deeper search."""
    return settings(
        max_examples=int(os.environ.get("AP_EPCHUNK_EXAMPLES", "100")),
        deadline=None,
        derandomize=True,
        database=None,
    )


class MLP(nn.Module):
    """``fc2(relu(fc1(x)))`` with a hidden width of ``2 * d``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.relu(self.fc1(x)))
        return out


class ResidualMLP(MLP):
    """``x + MLP(x)``: the residual joins inside the block."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + super().forward(x)


class Stack(nn.Module):
    """``layers.0 .. layers.<n-1>`` (each ``block(d)``) run one after the other."""

    def __init__(self, d: int, n_layers: int, block: Callable[[int], nn.Module] = MLP) -> None:
        super().__init__()
        self.layers = nn.ModuleList([block(d) for _ in range(n_layers)])

    @classmethod
    def of(cls, blocks: Iterable[nn.Module]) -> Stack:
        """A stack of the given, already built blocks."""
        stack = cls(0, 0)
        stack.layers.extend(blocks)
        return stack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class MoE(nn.Module):
    """Router, top-k gating, dense per-expert compute and an in-place ``tokens_per_expert``
    buffer update (a mutation a chunking pass must run chunk after chunk)."""

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
        tokens_per_expert: torch.Tensor = self.tokens_per_expert  # type: ignore[assignment]
        tokens_per_expert.add_(onehot.sum(dim=(0, 1)))
        weights = (gates.unsqueeze(-1) * onehot).sum(dim=1)  # [T, E]
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + weights[:, e : e + 1] * expert(x)
        return out


class MoEBlock(nn.Module):
    """``x + moe(proj(x))``.

    The residual joins *outside* the MoE input: autograd accumulates every use of a tensor in
    one chain, so a residual on the MoE input itself would interleave full-graph and per-chunk
    gradient terms and break bitwise equality with eager chunking.
    """

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.moe = MoE(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.moe(self.proj(x))
        return out


# ----------------------------------------------------------------------------- joint steps


def module_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A fresh ``functional_call`` state: detached copies of the parameters (requiring grad)
    and of the buffers (so a step that mutates a buffer leaves ``model`` untouched)."""
    state = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    state.update({n: b.detach().clone() for n, b in model.named_buffers()})
    return state


def joint_step(
    model: nn.Module, loss_fn: Callable[..., torch.Tensor] = F.mse_loss
) -> Callable[[dict[str, torch.Tensor], torch.Tensor, torch.Tensor], list[Any]]:
    """``step(state, x, y) -> [loss, *grads of the parameters in state, grad of x]``."""

    def step(state: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> list[Any]:
        out = torch.func.functional_call(model, state, (x,))
        loss = loss_fn(out, y)
        params = [v for v in state.values() if v.requires_grad]
        grads = torch.autograd.grad(loss, [*params, x])
        return [loss, *grads]

    return step


def run_joint(
    gm: torch.fx.GraphModule, model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> tuple[list[Any], dict[str, torch.Tensor]]:
    """Run a joint graph of :func:`joint_step` on a fresh :func:`module_state` of ``model``:
    its outputs and the (possibly mutated) buffers it ran with."""
    state = module_state(model)
    out = gm(state, x.detach().clone().requires_grad_(), y.clone())
    return list(out), {n: b for n, b in state.items() if not b.requires_grad}


# ----------------------------------------------------------------------------- random models

#: Width of the random models' activations.
RANDOM_DIM = 4
#: The ops a random block's recipe draws from.
OPS = ("linear", "relu", "sin", "view", "split_cat", "token_mean", "gram")
#: Recipe ops whose output row depends on other rows: chunking changes their result by design.
TOKEN_MIXING = frozenset({"token_mean", "gram"})


class RandomBlock(nn.Module):
    """Runs a recipe over a ``[T, RANDOM_DIM]`` activation: per-token ops (linear, pointwise,
    views that keep the token dim, a multi-output ``split`` + ``cat``) and token-mixing ones (a
    mean over tokens, an ``x @ (x.T @ x)`` Gram product)."""

    def __init__(self, recipe: tuple[str, ...]) -> None:
        super().__init__()
        d = RANDOM_DIM
        self.recipe = recipe
        self.lins = nn.ModuleList([nn.Linear(d, d) for op in recipe if op == "linear"])
        self.scale = nn.Parameter(torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = RANDOM_DIM
        lin = iter(self.lins)
        for op in self.recipe:
            if op == "linear":
                x = next(lin)(x)
            elif op == "relu":
                x = torch.relu(x)
            elif op == "sin":
                x = torch.sin(x)
            elif op == "view":
                x = x.view(x.shape[0], 2, d // 2).transpose(1, 2).reshape(x.shape[0], d)
            elif op == "split_cat":
                a, b = x.split(d // 2, dim=1)  # type: ignore[no-untyped-call]
                x = torch.cat([torch.tanh(b), a], dim=1)
            elif op == "token_mean":
                x = x - x.mean(dim=0, keepdim=True)
            elif op == "gram":
                x = x @ (x.t() @ x) * 0.1
        return x * self.scale  # every parameter is used (the joint differentiates all of them)


@dataclass
class RandomModel:
    """A drawn model with its inputs and the chunking options drawn with it."""

    model: Stack
    x: torch.Tensor
    y: torch.Tensor
    num_chunks: int
    early: bool
    token_mixing: bool


@st.composite
def random_models(draw: st.DrawFn) -> RandomModel:
    """A :class:`Stack` of 1-2 :class:`RandomBlock` s of 1-4 ops, ``T = num_chunks * k``
    tokens (``k`` in 1..3: chunks of one token are included on purpose) and a random
    ``early`` flag (early gradient accumulation). Seeds torch's RNG from the draw."""
    recipes = [
        tuple(draw(st.lists(st.sampled_from(OPS), min_size=1, max_size=4)))
        for _ in range(draw(st.integers(1, 2)))
    ]
    torch.manual_seed(draw(st.integers(0, 2**16)))
    n = draw(st.sampled_from([2, 2, 4]))
    tokens = n * draw(st.sampled_from([1, 2, 2, 3]))
    return RandomModel(
        model=Stack.of(RandomBlock(r) for r in recipes),
        x=torch.randn(tokens, RANDOM_DIM),
        y=torch.randn(tokens, RANDOM_DIM),
        num_chunks=n,
        early=draw(st.booleans()),
        token_mixing=any(op in TOKEN_MIXING for r in recipes for op in r),
    )
