"""FSDP-style parameter sharding with autograd-aware functional collectives.

Every rank holds a dim-0 shard of each parameter. The forward all-gathers the full weight with
the functional ``all_gather_into_tensor`` + ``wait_tensor`` ops (which torch registers autograd
for), so the backward reduce-scatters the weight gradient back onto the
shard without any hooks. That is exactly the graph shape the ap passes target: placeholder ->
(optional cast) -> all_gather -> wait -> views -> matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from ap_tags.checks import require_instance, require_int
from torch import nn

from ap_backend import _compat

__all__ = ["Sharding", "gather", "shard_param", "single_rank_sharding"]


@dataclass(frozen=True)
class Sharding:
    """Where the parameters live: the process group (by name), its size, this rank, and the
    dtype parameters are cast to *before* the all-gather (``None`` keeps the parameter dtype;
    ``torch.bfloat16`` halves the gathered bytes as FSDP2 mixed precision does)."""

    group_name: str
    world_size: int
    rank: int
    gather_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        require_instance(self.group_name, str, where="Sharding", arg="group_name", expected="a str")
        require_int(self.world_size, where="Sharding", arg="world_size", minimum=1)
        require_int(self.rank, where="Sharding", arg="rank", minimum=0)
        if self.gather_dtype is not None:
            require_instance(
                self.gather_dtype,
                torch.dtype,
                where="Sharding",
                arg="gather_dtype",
                expected="a torch.dtype or None",
            )
        if self.rank >= self.world_size:
            raise ValueError(
                f"Sharding: rank {self.rank} is out of range for world_size {self.world_size}"
            )
        if self.world_size > 1:
            _compat.load_functional_collectives()

    @staticmethod
    def from_world(gather_dtype: torch.dtype | None = None) -> Sharding:
        """The default process group (gloo or the fake PG) must already be initialised."""
        if not dist.is_initialized():
            raise RuntimeError("Sharding.from_world: torch.distributed is not initialised")
        group = dist.group.WORLD
        assert group is not None
        return Sharding(
            group_name=group.group_name,
            world_size=dist.get_world_size(),
            rank=dist.get_rank(),
            gather_dtype=gather_dtype,
        )


def single_rank_sharding() -> Sharding:
    """A placeholder for building modules before any process group exists (world size 1 never
    issues a collective: :func:`gather` returns the parameter itself)."""
    return Sharding(group_name="", world_size=1, rank=0)


def shard_param(full: torch.Tensor, sharding: Sharding) -> nn.Parameter:
    """This rank's dim-0 slice of ``full``. Dim 0 must divide evenly: uneven shards would need
    padding, which the demo model avoids by construction."""
    require_instance(full, torch.Tensor, where="shard_param", arg="full", expected="a tensor")
    if full.shape[0] % sharding.world_size != 0:
        raise ValueError(
            f"shard_param: dim 0 of size {full.shape[0]} does not divide by world size "
            f"{sharding.world_size}"
        )
    rows = full.shape[0] // sharding.world_size
    shard = full[sharding.rank * rows : (sharding.rank + 1) * rows].clone()
    return nn.Parameter(shard)


def gather(shard: torch.Tensor, sharding: Sharding) -> torch.Tensor:
    """All-gather a dim-0 shard into the full tensor (autograd: reduce-scatter of the grad)."""
    if sharding.world_size == 1:
        return shard if sharding.gather_dtype is None else shard.to(sharding.gather_dtype)
    if not dist.is_initialized():
        raise RuntimeError(
            f"gather: process group {sharding.group_name!r} is not available "
            "(torch.distributed is not initialised)"
        )
    x = shard if sharding.gather_dtype is None else shard.to(sharding.gather_dtype)
    return _compat.all_gather_wait(x, sharding.world_size, sharding.group_name)
