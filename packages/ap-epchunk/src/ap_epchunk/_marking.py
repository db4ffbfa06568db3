"""Introducing the chunk dimension before tracing.

``mark_chunk_dim`` records which dim of an input carries tokens and, with a ``hint``, marks it
unbacked through Dynamo's ``mark_unbacked(hint_override=...)`` so one symbol carries "chunk
influence" through tracing (``torch.compile`` and :func:`ap_epchunk.trace_joint` both honour it).
Without a hint the dim stays static and the chunk pass is told which placeholders carry the
chunk dim through ``ChunkConfig.chunk_inputs``.
"""

from __future__ import annotations

import torch

from ._compat import mark_unbacked_fn
from ._errors import ChunkError

#: Attribute on a real tensor: ``{dim: hint}`` of the chunk dims marked on it.
CHUNK_DIMS_ATTR = "_ap_chunk_dims"


def mark_chunk_dim(tensor: torch.Tensor, dim: int, *, hint: int | None) -> torch.Tensor:
    """Mark ``tensor``'s ``dim`` as the chunk (token) dimension; returns ``tensor``.

    ``hint`` is the extent the graph will be concretized to (normally ``tensor.shape[dim]``);
    it must be even-ly divisible by the number of chunks later. ``hint=None`` keeps the dim
    static (nothing is marked for Dynamo; the extent is the tensor's own size).
    """
    if not isinstance(tensor, torch.Tensor):
        raise ChunkError(
            f"mark_chunk_dim: tensor must be a torch.Tensor, got {type(tensor).__name__}"
        )
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ChunkError(f"mark_chunk_dim: dim must be an int, got {dim!r}")
    if tensor.dim() == 0:
        raise ChunkError(f"mark_chunk_dim: cannot mark dim {dim} of a 0-d tensor")
    if not -tensor.dim() <= dim < tensor.dim():
        raise ChunkError(f"mark_chunk_dim: dim {dim} out of range for shape {tuple(tensor.shape)}")
    dim %= tensor.dim()
    if hint is not None:
        if isinstance(hint, bool) or not isinstance(hint, int) or hint < 2:
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
