"""What a partition saved for backward, measured the same way for every partitioner.

The first compilation runs torch's ``default_partition`` (no ap-partitioner report exists for
it), so ap-backend measures its forward graph itself, with the one count every report shares
(``ap_tags.counting.count_saved``): saved activation tensors, the distinct storages they keep
alive (a view of a saved base shares its storage), bytes per storage and saved symbols, graph
inputs excluded. A saved storage that is an all-gather's result
(``ap_tags.graph.is_all_gather_output``) keeps a full unsharded weight alive until backward --
the leak the FSDP recompute tags exist to prevent.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch.fx
from ap_tags.counting import count_saved
from ap_tags.graph import is_all_gather_output

__all__ = ["SavedSummary", "summarize_forward_saves"]


@dataclass(frozen=True)
class SavedSummary:
    """Saved activations of one partition. ``names`` are the saved activation tensors as the
    partition listed them; ``bases`` the distinct storages they keep alive, with their (shape,
    dtype) ``signatures`` (sorted), their ``(dtype, bytes)`` ``storage_keys`` (sorted: what
    storage-level equality compares), bytes per storage (``storage_bytes``, aligned with
    ``bases``) and total bytes. Counting by storage is what makes two partitions comparable:
    the first compilation saves ``rsqrt`` *and* ``detach(rsqrt)``, the second only ``rsqrt`` --
    two tensors against one, one storage either way.

    ``producers`` (aligned with ``bases``) names each storage the way a replay's report does
    (``PartitionReport.dropped_first_saves``): the base node's name, or ``parent[i]`` for an
    output of a multi-output op."""

    names: tuple[str, ...]
    bases: tuple[str, ...]
    signatures: tuple[tuple[tuple[int, ...], str], ...]
    nbytes: int
    all_gather_outputs: tuple[str, ...] = field(default=())
    storage_bytes: tuple[int, ...] = field(default=())
    symbols: tuple[str, ...] = field(default=())
    storage_keys: tuple[tuple[str, int], ...] = field(default=())
    producers: tuple[str, ...] = field(default=())
    producer_keys: tuple[tuple[str, int], ...] = field(default=())

    @property
    def count(self) -> int:
        """Distinct saved storages."""
        return len(self.bases)

    @property
    def tensor_count(self) -> int:
        """Saved activation tensors (views of one storage counted each)."""
        return len(self.names)

    def storage_keys_without(self, dropped: Iterable[str]) -> tuple[tuple[str, int], ...]:
        """``storage_keys`` less the storages whose producer is in ``dropped`` (the saves a
        replay reported it did not keep): what an exact replay of this partition saves."""
        gone = set(dropped)
        keys = Counter(self.storage_keys)
        for key, producer in zip(self.producer_keys, self.producers, strict=True):
            if producer in gone:
                keys[key] -= 1
        return tuple(sorted(keys.elements()))

    def to_dict(self) -> dict[str, object]:
        return {
            "count": self.count,
            "tensor_count": self.tensor_count,
            "sym_count": len(self.symbols),
            "bytes": self.nbytes,
            "names": list(self.names),
            "bases": list(self.bases),
            "bytes_by_storage": dict(zip(self.bases, self.storage_bytes, strict=True)),
            "all_gather_outputs_saved": len(self.all_gather_outputs),
        }


def summarize_forward_saves(fw_module: torch.fx.GraphModule, num_fwd_outputs: int) -> SavedSummary:
    """Summarise the saved activations of a partitioned forward graph with ap-tags' one count
    (``ap_tags.counting.count_saved``), the same one ap-partitioner's ``PartitionReport``
    uses."""
    counted = count_saved(fw_module, num_fwd_outputs)
    nodes = {n.name: n for n in fw_module.graph.nodes}
    return SavedSummary(
        names=counted.tensors,
        bases=counted.storages,
        signatures=counted.signatures,
        nbytes=counted.nbytes,
        all_gather_outputs=tuple(b for b in counted.storages if is_all_gather_output(nodes[b])),
        storage_bytes=counted.storage_bytes,
        symbols=counted.symbols,
        storage_keys=counted.storage_keys,
        producers=tuple(_producer(nodes[b]) for b in counted.storages),
        producer_keys=tuple(
            (str(nodes[b].meta["val"].dtype), n)
            for b, n in zip(counted.storages, counted.storage_bytes, strict=True)
        ),
    )


def _producer(node: torch.fx.Node) -> str:
    """``node``'s name, or ``parent[i]`` for ``getitem(parent, i)`` (the name a replay's
    provenance gives it: getitems are not dispatched, so the retrace knows only the parent)."""
    parent = node.args[0] if node.args else None
    if node.target is operator.getitem and isinstance(parent, torch.fx.Node):
        return f"{parent.name}[{node.args[1]}]"
    return node.name
