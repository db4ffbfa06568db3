"""``EagerChunked``: the numerical reference for graph chunking.

It splits every tensor argument along ``dim`` into ``num_chunks`` equal chunks, runs the
wrapped module's own forward once per chunk (chunk 0 first) and concatenates the outputs along
``dim``. Graph chunking with ``early_grad_accumulation=False`` must match it bitwise: same
splits, same per-chunk ops, same cat, and parameter gradients accumulated the way autograd
accumulates the N uses of a parameter.
"""

from __future__ import annotations

from typing import Any

import torch
from ap_tags.checks import require_instance, require_int
from torch import nn

from ._errors import ChunkError


def _cat(outputs: list[Any], dim: int) -> Any:
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs, dim=dim)
    if isinstance(first, (tuple, list)):
        return type(first)(_cat([o[i] for o in outputs], dim) for i in range(len(first)))
    raise ChunkError(
        f"EagerChunked can only concatenate tensors (or tuples/lists of them), "
        f"got {type(first).__name__}"
    )


class EagerChunked(nn.Module):
    """Run ``module`` on ``num_chunks`` equal chunks of its inputs along ``dim``."""

    def __init__(self, module: nn.Module, dim: int, num_chunks: int) -> None:
        super().__init__()
        where = "EagerChunked"
        require_instance(module, nn.Module, where=where, arg="module", expected="an nn.Module")
        require_int(num_chunks, where=where, arg="num_chunks", minimum=2)
        require_int(dim, where=where, arg="dim")
        self.module = module
        self.dim = dim
        self.num_chunks = num_chunks

    def _split(self, value: Any) -> list[Any]:
        if not isinstance(value, torch.Tensor):
            return [value] * self.num_chunks
        extent = value.shape[self.dim]
        if extent % self.num_chunks:
            raise ChunkError(
                f"EagerChunked: extent {extent} of dim {self.dim} is not divisible by "
                f"num_chunks={self.num_chunks}"
            )
        size = extent // self.num_chunks
        return list(torch.split(value, [size] * self.num_chunks, dim=self.dim))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        split_args = [self._split(a) for a in args]
        split_kwargs = {k: self._split(v) for k, v in kwargs.items()}
        outputs = [
            self.module(*(a[i] for a in split_args), **{k: v[i] for k, v in split_kwargs.items()})
            for i in range(self.num_chunks)
        ]
        return _cat(outputs, self.dim)
