"""What a partition saved for backward, measured the same way for every partitioner.

The first compilation runs torch's ``default_partition`` (no ap-partitioner report exists for
it), so ap-backend measures its forward graph itself, with the one definition of "saved" every
report shares (``ap_tags.graph.activation_storages``): the distinct storages of the values the
forward hands the backward, graph inputs excluded. A saved storage that is an all-gather's result
(``ap_tags.graph.is_all_gather_output``) keeps a full unsharded weight alive until backward --
the leak the FSDP recompute tags exist to prevent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx
from ap_tags.graph import (
    activation_storages,
    is_all_gather_output,
    saved_for_backward,
    storage_nbytes,
)

__all__ = ["SavedSummary", "summarize_forward_saves"]


@dataclass(frozen=True)
class SavedSummary:
    """Saved activations of one partition. ``names`` are the saved forward values as the
    partition listed them; ``bases`` the distinct storages they keep alive, with their (shape,
    dtype) ``signatures`` (sorted) and total bytes. Counting by storage is what makes two
    partitions comparable: the first compilation saves ``rsqrt`` *and* ``detach(rsqrt)``, the
    second only ``rsqrt`` -- one tensor either way."""

    names: tuple[str, ...]
    bases: tuple[str, ...]
    signatures: tuple[tuple[tuple[int, ...], str], ...]
    nbytes: int
    all_gather_outputs: tuple[str, ...] = field(default=())

    @property
    def count(self) -> int:
        """Distinct saved tensors (storages)."""
        return len(self.bases)

    def to_dict(self) -> dict[str, object]:
        return {
            "count": self.count,
            "bytes": self.nbytes,
            "names": list(self.names),
            "bases": list(self.bases),
            "all_gather_outputs_saved": len(self.all_gather_outputs),
        }


def summarize_forward_saves(fw_module: torch.fx.GraphModule, num_fwd_outputs: int) -> SavedSummary:
    """Summarise the saved activations of a partitioned forward graph, with ap-tags' one
    definition of "saved" (``saved_for_backward`` + ``activation_storages``), the same one
    ap-partitioner's ``PartitionReport`` uses."""
    saved = saved_for_backward(fw_module, num_fwd_outputs)
    bases = activation_storages(saved)
    return SavedSummary(
        names=tuple(n.name for n in saved if isinstance(n.meta.get("val"), torch.Tensor)),
        bases=tuple(b.name for b in bases),
        signatures=tuple(sorted(_signature(b) for b in bases)),
        nbytes=storage_nbytes(bases),
        all_gather_outputs=tuple(b.name for b in bases if is_all_gather_output(b)),
    )


def _signature(node: torch.fx.Node) -> tuple[tuple[int, ...], str]:
    val = node.meta["val"]
    return tuple(int(s) if isinstance(s, int) else -1 for s in val.shape), str(val.dtype)
