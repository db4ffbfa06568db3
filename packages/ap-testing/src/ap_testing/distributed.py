"""Process groups for tests: torch's ``fake`` backend (structure only) and an autograd-aware
all-gather.

The fake backend runs every collective locally and returns garbage data: use it for graph
structure, sizes and compile behaviour, never for numbers. Real numerics need real ranks (gloo
on 127.0.0.1; see ``ap_backend.demo.spawn_ranks``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

__all__ = [
    "FAKE_WORLD_SIZE",
    "chunked_head_step",
    "fake_world",
    "gather_autograd",
    "single_rank_gloo",
]

#: World size of the fake process group (8: FSDP shards of 1/8, as on a node of 8 GPUs).
FAKE_WORLD_SIZE = 8


@contextlib.contextmanager
def fake_world(world_size: int = FAKE_WORLD_SIZE) -> Iterator[str]:
    """Initialise the default process group on the ``fake`` backend for the block; yields the
    WORLD group's name. Destroys it (and resets Dynamo, whose caches hold graphs that name the
    group) on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        group = dist.group.WORLD
        assert group is not None
        yield group.group_name
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


@contextlib.contextmanager
def single_rank_gloo(subgroups: int = 1) -> Iterator[tuple[str, ...]]:
    """A one-rank gloo world for the block; yields the names of WORLD and of ``subgroups``
    more groups on rank 0. Every collective then runs on real data (an identity at world size
    1), so a graph naming these groups can be executed and compared before and after a pass."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp}/store")
        try:
            world = dist.group.WORLD
            assert world is not None
            names = [world.group_name]
            for _ in range(subgroups):
                group = dist.new_group([0])
                assert isinstance(group, dist.ProcessGroup)
                names.append(group.group_name)
            yield tuple(names)
        finally:
            dist.destroy_process_group()
            torch._dynamo.reset()


def gather_autograd(weight: torch.Tensor, group: str | None = None) -> torch.Tensor:
    """Autograd-aware functional all-gather along dim 0 (its backward is a reduce-scatter), on
    ``group`` (default: WORLD). The graph shape FSDP produces: ``all_gather -> wait``."""
    fn = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    target: Any = dist.group.WORLD if group is None else group
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        gathered: torch.Tensor = fn(weight, 0, target)
    return gathered


def chunked_head_step(x: torch.Tensor, *shards: torch.Tensor) -> list[torch.Tensor]:
    """A train step as graph_trainer traces it (``make_fx`` of forward and ``autograd.grad``,
    no functionalization): FSDP-gathered weights, a head computed chunk by chunk whose
    hidden-state gradient is written with ``copy_`` into slices of one buffer and whose weight
    gradient is accumulated with ``add_``, then the backward through the trunk."""
    weights = [gather_autograd(s) for s in shards]
    h = x
    for w in weights[:-1]:
        h = torch.relu(h @ w.t())
    hd = h.detach().requires_grad_(True)
    head = weights[-1].detach().requires_grad_(True)
    grad_h, grad_head = torch.zeros_like(hd), torch.zeros_like(head)
    loss = torch.zeros(())
    rows = h.shape[0] // 2
    for i in range(2):
        part = (hd[i * rows : (i + 1) * rows] @ head.t()).pow(2).mean()
        g_h, g_head = torch.autograd.grad(part, (hd, head))
        grad_h[i * rows : (i + 1) * rows].copy_(g_h[i * rows : (i + 1) * rows])
        grad_head.add_(g_head)
        loss = loss + part.detach()
    grads = torch.autograd.grad([h, weights[-1]], shards, [grad_h, grad_head])
    return [loss, *grads]
