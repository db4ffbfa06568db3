"""What a partition saved for backward, measured the same way for every partitioner.

The first compilation runs torch's ``default_partition`` (no ap-partitioner report exists for
it), so ap-backend measures its forward graph itself: the forward outputs beyond
``num_fwd_outputs`` that are computed values (primals are parameters/inputs, not activations).
An "all-gather output" is a saved value produced by ``wait_tensor(all_gather_into_tensor(..))``
possibly through views: saving one keeps a full unsharded weight alive until backward, which is
the leak the FSDP recompute tags exist to prevent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

__all__ = [
    "SavedSummary",
    "is_all_gather_output",
    "storage_base",
    "summarize_forward_saves",
]

_C10D = "_c10d_functional"


def _is_view(node: torch.fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and bool(target.is_view)


def is_all_gather_output(node: torch.fx.Node) -> bool:
    """True if ``node`` is a wait on an all-gather, or a view chain ending in one."""
    if not isinstance(node, torch.fx.Node):
        raise TypeError(
            f"is_all_gather_output: expected a torch.fx.Node, got {type(node).__name__}"
        )
    cur: torch.fx.Node | None = node
    while cur is not None and cur.op == "call_function":
        if cur.target is torch.ops._c10d_functional.wait_tensor.default:
            src = cur.args[0]
            return (
                isinstance(src, torch.fx.Node)
                and src.target is torch.ops._c10d_functional.all_gather_into_tensor.default
            )
        if not _is_view(cur):
            return False
        first = cur.args[0] if cur.args else None
        cur = first if isinstance(first, torch.fx.Node) else None
    return False


def _is_alias(node: torch.fx.Node) -> bool:
    """Ops whose output shares its input's storage: views, ``detach``, ``_unsafe_view``."""
    aten = torch.ops.aten
    return node.op == "call_function" and (
        _is_view(node)
        or node.target in (aten._unsafe_view.default, aten.detach.default, aten.alias.default)
    )


def storage_base(node: torch.fx.Node) -> torch.fx.Node:
    """The node that owns the storage ``node`` aliases (itself if it is not an alias). Saving a
    view keeps its base alive, so saved sets are compared and sized by bases: the first
    compilation saves ``rsqrt`` *and* ``detach(rsqrt)``, the second only ``rsqrt`` -- one
    tensor either way."""
    cur = node
    while _is_alias(cur) and cur.args and isinstance(cur.args[0], torch.fx.Node):
        cur = cur.args[0]
    return cur


def _nbytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return int(val.numel()) * val.element_size() if not _has_symbols(val) else 0
    return 0


def _has_symbols(val: torch.Tensor) -> bool:
    return any(not isinstance(s, int) for s in val.shape)


@dataclass(frozen=True)
class SavedSummary:
    """Saved activations of one partition. ``names`` are the saved forward values as the
    partition listed them; ``bases`` the distinct storages they keep alive (see
    :func:`storage_base`), with their (shape, dtype) ``signatures`` (sorted) and total bytes."""

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
        nbytes=sum(_nbytes(b) for b in bases),
        all_gather_outputs=tuple(n.name for n in saved if is_all_gather_output(n)),
    )


def _signature(node: torch.fx.Node) -> tuple[tuple[int, ...], str]:
    val = node.meta["val"]
    return tuple(int(s) if isinstance(s, int) else -1 for s in val.shape), str(val.dtype)
