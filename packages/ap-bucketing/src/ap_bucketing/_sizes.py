"""Hint-safe byte sizes of collective operands.

Bucketing is a policy decision, so it may use optimization hints for symbolic sizes but must
never guard on them (raw ``numel()`` comparisons on a SymInt install guards, or raise on an
unbacked symbol). An unbacked size with a hint (``mark_unbacked(..., hint_override=N)``) is sized
by its hint; a size without any hint is reported as ``None`` so the caller can leave that
collective unbucketed instead of crashing deep inside torch.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from . import _compat


class MissingValueError(ValueError):
    """A collective (or its input) has no ``meta['val']`` tensor to size it by."""


def hint_int(value: int | torch.SymInt) -> int | None:
    """Concrete int for ``value`` from its hint, or ``None`` when no hint exists (what
    ``ap_tags.graph.size_hint`` answers too; a cross-package test holds the two together)."""
    return value if isinstance(value, int) else _compat.symint_hint(value)


def _tensor_bytes(node: fx.Node, role: str, owner: fx.Node) -> int | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise MissingValueError(
            f"collective {owner.name!r}: its {role} {node.name!r} has no tensor meta['val'] "
            f"(got {type(val).__name__}); bucketing needs it to size the collective"
        )
    numel = hint_int(val.numel())
    if numel is None:
        return None
    return numel * val.dtype.itemsize


def collective_bytes(coll: fx.Node) -> int | None:
    """``max(output bytes, first input bytes)`` of a collective; ``None`` if a size is unhinted.

    The max covers both all-gathers (output larger) and reduce-scatters (input larger), the
    same rule torch's greedy bucketer uses.
    """
    inputs = coll.all_input_nodes
    if not inputs:
        raise MissingValueError(f"collective {coll.name!r} has no tensor input")
    out = _tensor_bytes(coll, "output", coll)
    inp = _tensor_bytes(inputs[0], "input", coll)
    if out is None or inp is None:
        return None
    return max(out, inp)
