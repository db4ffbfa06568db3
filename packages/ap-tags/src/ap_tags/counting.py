"""``count_saved``: the one way every report counts what a partition saved for backward.

ap-backend's summary of the first partition (torch's ``default_partition``), its summary of the
second compilation's partition, and ap-partitioner's ``PartitionReport`` all call this one pure
function on the forward graph's saved outputs, so their numbers are comparable field by field.

Definitions (issue #23, "exact replay, defined at storage level"):

* A saved **tensor** is a tensor value the forward hands the backward whose storage is not a
  graph input (the caller holds inputs anyway).
* A saved **storage** is what those tensors keep alive: a view of a saved base (followed by op
  schema aliasing, ``ap_tags.graph.storage_base``) shares the base's storage, so saving ``relu``
  and ``view(relu)`` is two tensors and one storage. The backward can rebuild such a view from
  its base for free, which is why replays are compared by storage.
* **Bytes** are counted once per storage (symbolic sizes by their hints, 0 when unhinted).
* **Symbols** are saved SymInt/SymFloat/SymBool values (and plain Python scalars).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.fx

from .graph import node_nbytes, saved_for_backward, storage_base

__all__ = ["SavedCount", "count_saved", "count_saved_values"]

Signature = tuple[tuple[int, ...], str]
_SCALARS = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)


@dataclass(frozen=True)
class SavedCount:
    """A partition's saved set, counted at tensor and at storage level.

    ``tensors``: names of the saved activation tensors (forward-output order).
    ``storages``: names of the distinct storage bases they keep alive (first-seen order).
    ``storage_bytes``: bytes per storage, aligned with ``storages``.
    ``signatures``: ``(shape, dtype)`` per storage, sorted (an unhinted extent is ``-1``): the
    multiset of storage shapes. ``storage_keys``: ``(dtype, bytes)`` per storage, sorted: the
    multiset two partitions are compared by at storage level (a storage has no shape: the
    first compilation may keep a ``(2, 2, 8, 8)`` result alive where the retrace keeps the
    ``(16, 16)`` matmul it is a reshape of). ``inputs``: saved tensors whose storage is a graph
    input (not activations). ``symbols``: saved symbolic/scalar values.
    """

    tensors: tuple[str, ...] = ()
    storages: tuple[str, ...] = ()
    storage_bytes: tuple[int, ...] = ()
    signatures: tuple[Signature, ...] = ()
    storage_keys: tuple[tuple[str, int], ...] = ()
    inputs: tuple[str, ...] = ()
    symbols: tuple[str, ...] = ()

    @property
    def tensor_count(self) -> int:
        return len(self.tensors)

    @property
    def storage_count(self) -> int:
        return len(self.storages)

    @property
    def symbol_count(self) -> int:
        return len(self.symbols)

    @property
    def nbytes(self) -> int:
        return sum(self.storage_bytes)

    def bytes_by_storage(self) -> dict[str, int]:
        return dict(zip(self.storages, self.storage_bytes, strict=True))


def _signature(node: torch.fx.Node) -> Signature:
    val = node.meta["val"]
    shape = tuple(int(s) if isinstance(s, int) else -1 for s in val.shape)
    return shape, str(val.dtype)


def count_saved_values(values: Iterable[torch.fx.Node]) -> SavedCount:
    """Count saved forward values (the nodes a forward graph returns for its backward)."""
    tensors: list[str] = []
    inputs: list[str] = []
    symbols: list[str] = []
    bases: dict[torch.fx.Node, None] = {}
    for value in values:
        val = value.meta.get("val")
        if isinstance(val, _SCALARS):
            symbols.append(value.name)
            continue
        if not isinstance(val, torch.Tensor):
            continue  # opaque objects (process groups, script objects) are neither
        base = storage_base(value)
        if base.op == "placeholder" or not isinstance(base.meta.get("val"), torch.Tensor):
            inputs.append(value.name)
            continue
        tensors.append(value.name)
        bases.setdefault(base)
    return SavedCount(
        tensors=tuple(tensors),
        storages=tuple(b.name for b in bases),
        storage_bytes=tuple(node_nbytes(b) for b in bases),
        signatures=tuple(sorted(_signature(b) for b in bases)),
        storage_keys=tuple(sorted((str(b.meta["val"].dtype), node_nbytes(b)) for b in bases)),
        inputs=tuple(inputs),
        symbols=tuple(symbols),
    )


def count_saved(fw_module: torch.fx.GraphModule, num_fwd_outputs: int) -> SavedCount:
    """Count what a partitioned forward hands its backward (outputs past ``num_fwd_outputs``)."""
    return count_saved_values(saved_for_backward(fw_module, num_fwd_outputs))
