"""Toy FSDP-style models: every weight is a dim-0 shard all-gathered in forward.

The graph shape the ap passes target -- ``shard -> (cast) -> all_gather -> wait -> views ->
matmul`` -- with autograd-aware functional collectives, so the backward reduce-scatters the
weight gradient. Written for tests and benchmarks of this workspace; the models nobody here
wrote live in the conformance zoo (``zoo/``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .distributed import FAKE_WORLD_SIZE, gather_autograd

__all__ = ["Block", "FsdpStack", "ShardedLinear", "Transformer"]


class ShardedLinear(nn.Module):
    """Holds a dim-0 shard of the weight; gathers it (optionally cast first) in forward."""

    def __init__(
        self, d_in: int, d_out: int, cast: torch.dtype | None, world: int = FAKE_WORLD_SIZE
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out // world, d_in) * 0.02)
        self.cast = cast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cast is None:
            return F.linear(x, gather_autograd(self.weight))
        return F.linear(x.to(self.cast), gather_autograd(self.weight.to(self.cast))).float()


class Block(nn.Module):
    """RMSNorm -> causal SDPA attention -> RMSNorm -> SiLU MLP, every projection sharded."""

    def __init__(self, dim: int, heads: int, cast: torch.dtype | None, ffn_mult: int) -> None:
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (ShardedLinear(dim, dim, cast) for _ in range(4))
        self.w1 = ShardedLinear(dim, ffn_mult * dim, cast)
        self.w2 = ShardedLinear(ffn_mult * dim, dim, cast)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        y = F.rms_norm(x, (d,))
        q, k, v = (
            m(y).view(b, s, self.heads, d // self.heads).transpose(1, 2)
            for m in (self.wq, self.wk, self.wv)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, d))
        out: torch.Tensor = x + self.w2(F.silu(self.w1(F.rms_norm(x, (d,)))))
        return out


class Transformer(nn.Module):
    """``layers`` blocks; the loss (``mean(x**2)``) is computed inside, so the output is a
    scalar that requires grad. Six FSDP all-gather chains per layer."""

    def __init__(
        self,
        layers: int = 2,
        dim: int = 64,
        heads: int = 4,
        cast: torch.dtype | None = torch.bfloat16,
        ffn_mult: int = 2,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dim, heads, cast, ffn_mult) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


class FsdpStack(nn.Module):
    """``layers`` x (all-gather a 1/8 weight shard, matmul, relu): the smallest FSDP graph."""

    def __init__(self, group: str, layers: int = 4, dim: int = 32) -> None:
        super().__init__()
        self.group = group
        self.shards = nn.ParameterList(
            nn.Parameter(torch.randn(dim // FAKE_WORLD_SIZE, dim)) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        for shard in self.shards:
            weight = funcol.all_gather_tensor(shard, 0, self.group)  # type: ignore[arg-type]
            x = torch.relu(x @ weight.t())
        return x
