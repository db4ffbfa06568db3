"""Introducing the chunk dimension before tracing.

``mark_chunk_dim`` records which dim of an input carries tokens and, with a ``hint``, marks it
unbacked through Dynamo's ``mark_unbacked(hint_override=...)`` so one symbol carries "chunk
influence" through tracing (``torch.compile`` and :func:`ap_epchunk.trace_joint` both honour it).
Without a hint the dim stays static and the chunk pass is told which placeholders carry the
chunk dim through ``ChunkConfig.chunk_inputs``.
"""

from __future__ import annotations

import torch
from ap_tags.checks import require_instance, require_int

from ._compat import mark_unbacked_fn
from ._errors import ChunkError

#: Attribute on a real tensor: ``{dim: hint}`` of the chunk dims marked on it.
CHUNK_DIMS_ATTR = "_ap_chunk_dims"


def mark_chunk_dim(tensor: torch.Tensor, dim: int, *, hint: int | None) -> torch.Tensor:
    """Mark ``tensor``'s ``dim`` as the chunk (token) dimension; returns ``tensor``.

    ``hint`` is the extent the graph will be concretized to (normally ``tensor.shape[dim]``);
    it must be evenly divisible by the number of chunks later. ``hint=None`` keeps the dim
    static (nothing is marked for Dynamo; the extent is the tensor's own size).

    An argument of the wrong type raises ``TypeError``; a 0-d tensor, a ``dim`` out of range or
    a ``hint`` below 2 raise ``ChunkError`` (a ``ValueError``).
    """
    where = "mark_chunk_dim"
    require_instance(tensor, torch.Tensor, where=where, arg="tensor", expected="a torch.Tensor")
    require_int(dim, where=where, arg="dim")
    if hint is not None:
        require_int(hint, where=where, arg="hint")
    if tensor.dim() == 0:
        raise ChunkError(f"mark_chunk_dim: cannot mark dim {dim} of a 0-d tensor")
    if not -tensor.dim() <= dim < tensor.dim():
        raise ChunkError(f"mark_chunk_dim: dim {dim} out of range for shape {tuple(tensor.shape)}")
    dim %= tensor.dim()
    if hint is not None:
        if hint < 2:
            raise ChunkError(f"mark_chunk_dim: hint must be an int >= 2, got {hint!r}")
        mark_unbacked_fn()(tensor, dim, hint_override=hint)
    marks = dict(getattr(tensor, CHUNK_DIMS_ATTR, {}))
    marks[dim] = hint
    setattr(tensor, CHUNK_DIMS_ATTR, marks)
    return tensor


def chunk_dims_of(tensor: torch.Tensor) -> dict[int, int | None]:
    """The ``{dim: hint}`` marks ``mark_chunk_dim`` left on ``tensor`` (empty when unmarked)."""
    marks: dict[int, int | None] = getattr(tensor, CHUNK_DIMS_ATTR, {})
    return dict(marks)
