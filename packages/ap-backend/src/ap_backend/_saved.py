"""What a partition saved for backward, measured the same way for every partitioner.

The first compilation runs torch's ``default_partition`` (no ap-partitioner report exists for
it), so ap-backend measures its forward graph itself: the forward outputs beyond
``num_fwd_outputs`` that are computed values (primals are parameters/inputs, not activations).
Saved values are counted and sized by storage (``ap_tags.graph.storage_base``), and a saved
value whose storage is an all-gather's result (``ap_tags.graph.is_all_gather_output``) keeps a
full unsharded weight alive until backward -- the leak the FSDP recompute tags exist to prevent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx
from ap_tags.graph import is_all_gather_output, node_nbytes, storage_base

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
    """Summarise the saved activations of a partitioned forward graph."""
    outputs = fw_module.graph.output_node().args[0]
    assert isinstance(outputs, tuple | list)
    saved = [
        n
        for n in outputs[num_fwd_outputs:]
        if isinstance(n, torch.fx.Node)
        and n.op == "call_function"
        and isinstance(n.meta.get("val"), torch.Tensor)
    ]
    bases = list(dict.fromkeys(storage_base(n) for n in saved))
    # A view of a primal (e.g. the reshaped targets) keeps an input alive, not an activation.
    bases = [
        b for b in bases if b.op != "placeholder" and isinstance(b.meta.get("val"), torch.Tensor)
    ]
    return SavedSummary(
        names=tuple(n.name for n in saved),
        bases=tuple(b.name for b in bases),
        signatures=tuple(sorted(_signature(b) for b in bases)),
        nbytes=sum(node_nbytes(b) for b in bases),
        all_gather_outputs=tuple(n.name for n in saved if is_all_gather_output(n)),
    )


def _signature(node: torch.fx.Node) -> tuple[tuple[int, ...], str]:
    val = node.meta["val"]
    return tuple(int(s) if isinstance(s, int) else -1 for s in val.shape), str(val.dtype)
