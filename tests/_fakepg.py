"""Fake process group (world size 8) for structure-only tests: its data is garbage."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


@contextmanager
def fake_world(world_size: int = 8) -> Iterator[None]:
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
