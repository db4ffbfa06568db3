"""The demo model on torchtitan's SimpleFSDP instead of the model kit's own all-gathers.

SimpleFSDP (``torchtitan.experiments.graph_trainer.simple_fsdp.data_parallel(model, mesh,
mode="fully_shard")``) is the FSDP that graph-based trainers use: every parameter becomes a
``Shard(0)`` DTensor, and each module's class is swapped for a subclass whose parameter names
are properties that redistribute the DTensor to ``Replicate`` (an all-gather in forward, a
reduce-scatter of the gradient in backward). torchtitan is an optional dependency: only
``TrainSpec(fsdp="simple")`` / ``ap-backend demo --fsdp simple`` import it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["SIMPLE_FSDP", "local_tensor", "require_simple_fsdp", "simple_fsdp"]

#: Where SimpleFSDP lives in the torchtitan wheel.
SIMPLE_FSDP = "torchtitan.experiments.graph_trainer.simple_fsdp"


def require_simple_fsdp() -> Any:
    """The ``simple_fsdp`` module, or an ``ImportError`` saying what to install."""
    import importlib

    try:
        return importlib.import_module(SIMPLE_FSDP)
    except ImportError as exc:
        raise ImportError(
            f"--fsdp simple needs torchtitan's SimpleFSDP ({SIMPLE_FSDP}): install torchtitan "
            f"(pip install torchtitan); the default --fsdp ap needs nothing extra ({exc})"
        ) from exc


def simple_fsdp(model: nn.Module, world_size: int) -> nn.Module:
    """``model`` (built unsharded, identically on every rank) fully sharded by SimpleFSDP on a
    CPU mesh over the default process group."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    result: nn.Module = require_simple_fsdp().data_parallel(model, mesh, mode="fully_shard")
    return result


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a parameter's gradient), or ``t`` itself."""
    to_local = getattr(t, "to_local", None)
    return t if to_local is None else to_local()
