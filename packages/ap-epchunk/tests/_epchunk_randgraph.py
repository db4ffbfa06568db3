"""Random chunkable models for ap-epchunk's graph-safety properties (hypothesis).

A ``Stack`` of 1-2 blocks, each running a random recipe over a ``[T, D]`` activation:
per-token ops (linear, pointwise, parameter scale, views that keep the token dim, a
multi-output ``split`` + ``cat``) and, sometimes, token-mixing ops (a mean over tokens, a
``x.T @ x`` Gram matrix) whose chunked result differs from the unchunked one by design: the
reference for chunking is ``EagerChunked`` (split the input, run per chunk, cat). Tracing goes
through the package's own ``trace_joint`` (joint forward+backward graph). The module name is
package-specific: every package's tests may run in one pytest process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from torch import nn

D = 4
OPS = ("linear", "relu", "sin", "view", "split_cat", "token_mean", "gram")
TOKEN_MIXING = frozenset({"token_mean", "gram"})


class RandomBlock(nn.Module):
    def __init__(self, recipe: tuple[str, ...]) -> None:
        super().__init__()
        self.recipe = recipe
        self.lins = nn.ModuleList([nn.Linear(D, D) for op in recipe if op == "linear"])
        self.scale = nn.Parameter(torch.randn(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lin = iter(self.lins)
        for op in self.recipe:
            if op == "linear":
                x = next(lin)(x)
            elif op == "relu":
                x = torch.relu(x)
            elif op == "sin":
                x = torch.sin(x)
            elif op == "view":
                x = x.view(x.shape[0], 2, D // 2).transpose(1, 2).reshape(x.shape[0], D)
            elif op == "split_cat":
                a, b = x.split(D // 2, dim=1)
                x = torch.cat([torch.tanh(b), a], dim=1)
            elif op == "token_mean":
                x = x - x.mean(dim=0, keepdim=True)
            elif op == "gram":
                x = x @ (x.t() @ x) * 0.1
        return x * self.scale  # every parameter is used (the joint differentiates all of them)


class Stack(nn.Module):
    def __init__(self, recipes: list[tuple[str, ...]]) -> None:
        super().__init__()
        self.layers = nn.ModuleList([RandomBlock(r) for r in recipes])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@dataclass
class RandomModel:
    model: Stack
    x: torch.Tensor
    y: torch.Tensor
    num_chunks: int
    early: bool
    token_mixing: bool


@st.composite
def random_models(draw: st.DrawFn) -> RandomModel:
    recipes = [
        tuple(draw(st.lists(st.sampled_from(OPS), min_size=1, max_size=4)))
        for _ in range(draw(st.integers(1, 2)))
    ]
    torch.manual_seed(draw(st.integers(0, 2**16)))
    n = draw(st.sampled_from([2, 2, 4]))
    tokens = n * draw(st.sampled_from([1, 2, 2, 3]))  # chunks of 1 token: refused (static)
    return RandomModel(
        model=Stack(recipes),
        x=torch.randn(tokens, D),
        y=torch.randn(tokens, D),
        num_chunks=n,
        early=draw(st.booleans()),
        token_mixing=any(op in TOKEN_MIXING for r in recipes for op in r),
    )
