"""Refusals of a single op in a chunk body: what no chunk copy of it could compute.

The planner (``_plan``) decides which ops form a region's body; these checks then say, per op,
why a chunk copy would be wrong -- a value carrying the chunk dim in several dims (attention
under sequence chunking), one the static probe could not compute, an ``as_strided`` offset into
the full storage, a traced token extent baked into a size list -- naming the op and its
source line, and, for static-mode failures, the hinted mark that avoids them.
"""

from __future__ import annotations

import torch
import torch.fx

from ._chunk_dims import MULTI, ChunkShapes, Unknown, size_arg_positions
from ._errors import ChunkError, source_of

aten = torch.ops.aten


def unknown_refusal(node: torch.fx.Node, d: Unknown, what: str) -> ChunkError:
    """A refusal at the node where shape propagation first failed (with its source line),
    saying which value of which region needed it."""
    if d.origin is None:
        return ChunkError(f"{what}: {d.reason}{_HINTED_ROUTE}", node)
    return ChunkError(f"{d.describe()}; {what}{_HINTED_ROUTE}", d.origin)


#: The way out of a static-mode refusal (only the static probe produces ``Unknown``).
_HINTED_ROUTE = (
    ". Static sizes cannot always tell the token dim from a constant (a view that flattens "
    "the tokens with another dim, a size equal to the token extent no input explains): mark "
    "the token "
    "inputs with ap_epchunk.mark_chunk_dim(t, dim, hint=t.shape[dim]) instead of hint=None, "
    "before precompile (or the first compiled call), and the token dim is one unbacked symbol "
    "that every batch-derived size follows"
)


def check_body_node(node: torch.fx.Node, root: str, shapes: ChunkShapes) -> None:
    d = shapes.dim(node)
    if d is MULTI:
        raise ChunkError(
            f"sequence chunking across attention is not supported: in region {root!r} this "
            "value carries the chunk dim in more than one dim, so its chunks would need tokens "
            "of other chunks (full K/V)",
            node,
        )
    if isinstance(d, Unknown):
        raise unknown_refusal(node, d, f"so this op of region {root!r} cannot be chunked")
    if node.target is aten.as_strided.default:
        offset = node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset")
        if offset is not None:
            raise ChunkError(
                f"as_strided with an explicit storage offset ({offset}) in chunked region "
                f"{root!r}: the offset addresses the full tensor's storage, a chunk lives at "
                f"another offset ({source_of(node)})",
                node,
            )
    if shapes.mode == "symbolic" and isinstance(node.meta.get("val"), torch.Tensor):
        if d is None:
            _check_baked_sizes(node, root, shapes)
        elif isinstance(d, int):
            _check_baked_chunk_entry(node, d, root, shapes)


def _check_baked_sizes(node: torch.fx.Node, root: str, shapes: ChunkShapes) -> None:
    """A size list of Python constants on an op whose input carries the chunk dim and whose
    output does not: the traced extent was baked into the graph (``x.view(4, 3)`` instead of
    ``x.view(-1, 3)``), and every chunk would be asked for the full size."""
    positions = size_arg_positions(node)
    if not positions:
        return
    inputs = [a for a in node.args if isinstance(a, torch.fx.Node)]
    if not any(isinstance(shapes.dim(a), int) for a in inputs):
        return
    hints = shapes.symbol_hints()
    sizes = [node.args[i] for i in positions if i < len(node.args)]
    consts = [s for size in sizes if isinstance(size, (list, tuple)) for s in size]
    baked = [c for c in consts if type(c) is int and c in hints.values()]
    what = f"the constant {baked[0]}" if baked else f"the constant size {sizes[0]}"
    raise ChunkError(
        f"{what} is baked into this op of chunked region {root!r}: its input carries the "
        f"chunk dim (hinted extent {sorted(hints.values())}) but its output "
        f"{list(node.meta['val'].shape)} does not, so every chunk would ask for the full "
        "extent; use -1 or the input's own size (x.shape[i]) so the chunk extent flows through "
        f"({source_of(node)})",
        node,
    )


def _check_baked_chunk_entry(node: torch.fx.Node, d: int, root: str, shapes: ChunkShapes) -> None:
    """The output carries the chunk dim at ``d``, but a size list says a Python constant there:
    each chunk copy would ask for that constant (the full extent) and fail at run time (``shape
    '[4, 3]' is invalid for input of size 6``). Only a size derived from the chunk extent (a
    SymInt, divided per chunk) is sound at the chunk dim."""
    rank = node.meta["val"].dim()
    for i in size_arg_positions(node):
        sizes = node.args[i] if i < len(node.args) else None
        if not isinstance(sizes, (list, tuple)) or len(sizes) != rank:
            continue
        entry = sizes[d]
        if type(entry) is int and entry != -1:
            raise ChunkError(
                f"the constant {entry} is baked into this op of chunked region {root!r} at the "
                f"chunk dim {d} of its size {list(sizes)}: every chunk would ask for the full "
                "extent; use -1 or the input's own size (x.shape[i]) so the chunk extent flows "
                f"through ({source_of(node)})",
                node,
            )
