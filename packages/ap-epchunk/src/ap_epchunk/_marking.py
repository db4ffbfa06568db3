"""Introducing the chunk dimension before tracing.

``mark_chunk_dim`` records which dim of an input carries tokens and, with a ``hint``, marks it
unbacked through Dynamo's ``mark_unbacked(hint_override=...)`` so one symbol carries "chunk
influence" through tracing (``torch.compile`` and :func:`ap_epchunk.trace_joint` both honour it).
Without a hint the dim stays static and the chunk pass is told which placeholders carry the
chunk dim through ``ChunkConfig.chunk_inputs``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx
from ap_tags.checks import require_instance, require_int
from ap_tags.tracing import aot_input_index

from ._compat import mark_unbacked_fn
from ._config import ChunkConfig
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


def chunk_inputs_from_marks(
    config: ChunkConfig, graph: torch.fx.Graph, inputs: Sequence[object]
) -> ChunkConfig:
    """``config`` with ``chunk_inputs`` naming the placeholders of ``graph`` whose inputs carry a
    :func:`mark_chunk_dim` mark. Input ``i`` is the placeholder AOTAutograd describes as flat
    argument ``i`` (``meta["desc"]``); in a graph without descriptors, placeholder ``i`` (a
    joint graph's ``primals`` follow the compiled graph's inputs in order, unless a tensor
    subclass argument -- a DTensor parameter -- expands to several placeholders, which is why
    the descriptors come first).

    This is how ``autoparallel_backend(ep_chunk=...)`` finds the token arguments of a user's
    own model: mark them (``hint=N``: the token dim is one unbacked symbol in the backend's
    graphs; ``hint=None``: static sizes) on the tensors
    the compiled module is first called with. ``config`` is returned unchanged when it already
    names ``chunk_inputs`` or when nothing is marked. Marks with different dims, or a marked
    input whose placeholder does not have its shape, raise ``ChunkError``.
    """
    if config.chunk_inputs:
        return config
    placeholders = list(graph.find_nodes(op="placeholder"))
    by_index = {aot_input_index(p): p for p in placeholders}
    by_index.pop(None, None)
    if not any(p.meta.get("desc") is not None for p in placeholders):
        by_index = dict(enumerate(placeholders))
    names: list[str] = []
    dims: set[int] = set()
    for i, value in enumerate(inputs):
        if not isinstance(value, torch.Tensor) or not chunk_dims_of(value):
            continue
        marks = chunk_dims_of(value)
        node = by_index.get(i)
        if node is None:
            raise ChunkError(
                f"marked input {i} has no placeholder of its own (the graph has "
                f"{len(placeholders)}); pass ChunkConfig.chunk_inputs explicitly"
            )
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() != value.dim():
            raise ChunkError(
                f"marked input {i} (shape {tuple(value.shape)}) does not match its placeholder "
                f"({getattr(val, 'shape', val)}); pass ChunkConfig.chunk_inputs explicitly",
                node,
            )
        names.append(node.name)
        dims.update(marks)
    if not names:
        return config
    if len(dims) > 1:
        raise ChunkError(
            f"inputs are marked with different chunk dims {sorted(dims)}; mark_chunk_dim one "
            "token dim per input, the same for every input"
        )
    return config.replace(chunk_inputs=tuple(names), dim=dims.pop())
