"""The functional collectives and ``torch._grouped_mm`` the model kit calls inside traced code.

Part of the compat seam (:mod:`ap_backend._compat`): every private torch name is looked up
at call time through ``SUPPORT``."""

from __future__ import annotations

from typing import Any

import torch

from ._support import SUPPORT


def load_functional_collectives() -> None:
    """Make ``torch.ops._c10d_functional.{all_gather_into_tensor,all_to_all_single,wait_tensor}``
    usable.

    Importing ``torch.distributed._functional_collectives`` registers the ops' autograd (the
    backward of an all-gather is a reduce-scatter of the gradient, that of an all-to-all the
    all-to-all with the split sizes swapped). Called when a sharded model is built, never
    inside traced code.
    """
    SUPPORT.module("torch.distributed._functional_collectives")
    ns: Any = torch.ops._c10d_functional
    for name in ("all_gather_into_tensor", "all_to_all_single", "wait_tensor"):
        try:
            getattr(ns, name)
        except (AttributeError, RuntimeError) as exc:
            raise SUPPORT.missing(f"torch.ops._c10d_functional.{name}") from exc


def all_gather_wait(shard: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    """``wait_tensor(all_gather_into_tensor(shard, world_size, group_name))``: the FSDP
    all-gather chain, as plain op calls so Dynamo traces it into the graph (checked by
    :func:`load_functional_collectives` beforehand)."""
    ns: Any = torch.ops._c10d_functional
    full: torch.Tensor = ns.wait_tensor(ns.all_gather_into_tensor(shard, world_size, group_name))
    return full


def all_to_all_wait(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group_name: str
) -> torch.Tensor:
    """``wait_tensor(all_to_all_single(x, output_splits, input_splits, group_name))``: the EP
    token exchange as torchtitan's ``AllToAllTokenDispatcher`` issues it under compile (split
    sizes may be unbacked SymInts read with ``.tolist()``); autograd runs the exchange back with
    the splits swapped (checked by :func:`load_functional_collectives` beforehand)."""
    ns: Any = torch.ops._c10d_functional
    out: torch.Tensor = ns.wait_tensor(
        ns.all_to_all_single(x, output_splits, input_splits, group_name)
    )
    return out


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)``: rows ``offs[i-1]:offs[i]`` of the 2-D ``a`` times
    the 3-D ``b[i]`` (one group per local expert; ``offs`` int32 cumulative row counts), the
    op torchtitan's ``GroupedExperts`` uses (CPU fp32 included; checked by
    :func:`require_grouped_mm` beforehand)."""
    out: torch.Tensor = torch._grouped_mm(a, b, offs=offs)
    return out


def require_grouped_mm() -> None:
    """Raise :class:`UnsupportedTorchError` unless this torch has ``torch._grouped_mm`` (checked
    when an expert-parallel model is built, so :func:`grouped_mm` itself is a plain call that
    Dynamo traces)."""
    SUPPORT.attr("torch", "_grouped_mm")
