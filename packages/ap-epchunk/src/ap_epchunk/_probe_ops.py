"""Per-op rules of the static probe (:mod:`ap_epchunk._static_shapes`), each a pure function
of a node and the chunk count: which ops make tensors from sizes alone and how a chunk of one is
made, where a view maps the chunk dim, which scatter operands share ``self``'s chunk dim, and the
broadcast check torch's fake ``index_put`` leaves out. Kept apart from the walk so each rule can
be read (and tested) without the probe's state."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx

aten = torch.ops.aten

VIEW_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}

#: Ops that make a tensor from sizes alone, with the position of the size argument.
CREATION_OPS: dict[Any, int] = {
    aten.full.default: 0,
    aten.zeros.default: 0,
    aten.ones.default: 0,
    aten.empty.memory_format: 0,
    aten.empty_strided.default: 0,
    aten.arange.default: 0,
    aten.arange.start: 1,
    aten.arange.start_step: 1,
    # a value without the chunk dim broadcast to a size list (the backward of a scalar loss:
    # ``expand(grad, [8, 8])``): a creation along its broadcast dims only (creation_dims)
    aten.expand.default: 1,
}


def is_creation(node: torch.fx.Node) -> bool:
    """Does ``node`` make a tensor from sizes alone (no input to follow a chunk dim from)?"""
    return node.op == "call_function" and node.target in CREATION_OPS


def view_out_dim(in_shape: list[int], c: int, out_shape: list[int], n: int) -> int | None:
    """Output dim a view maps input chunk dim ``c`` onto, keeping chunks contiguous."""
    outer = math.prod(in_shape[:c])
    for d in range(len(out_shape)):
        if math.prod(out_shape[:d]) == outer and out_shape[d] % n == 0 and out_shape[d] >= n:
            return d
        if math.prod(out_shape[:d]) > outer:
            break
    return None


def contiguous_strides(shape: list[int]) -> list[int]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return strides[::-1]


def chunked_creation_args(
    node: torch.fx.Node, d: int, num_chunks: int
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The arguments of creation op ``node`` with dim ``d`` of its size list divided by
    ``num_chunks``; None where a chunk of it is not the same op on a smaller size (an
    ``arange`` that does not start at 0 in steps of 1, a non-contiguous ``empty_strided``, a
    size that is not a plain int list)."""
    args, kwargs = list(node.args), dict(node.kwargs)
    pos = CREATION_OPS[node.target]
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    if node.target in (aten.arange.start, aten.arange.start_step):
        if args[0] != 0 or (len(args) > 2 and args[2] != 1):
            return None  # only 0..n: a chunk of it is 0..n/N (chunk-local positions)
    if pos >= len(args):
        return None
    sizes = args[pos]
    if node.target in CREATION_OPS and isinstance(sizes, int):
        sizes = [sizes]  # arange's end
        scalar = True
    else:
        scalar = False
    if not isinstance(sizes, (list, tuple)) or not all(type(s) is int for s in sizes):
        return None
    new = list(sizes)
    new[d] //= num_chunks
    args[pos] = new[0] if scalar else new
    if node.target is aten.empty_strided.default:
        strides = args[1]
        if not isinstance(strides, (list, tuple)) or list(strides) != contiguous_strides(
            list(sizes)
        ):
            return None
        args[1] = contiguous_strides(new)
    return tuple(args), kwargs


def creation_dims(node: torch.fx.Node, num_chunks: int) -> list[int]:
    """The dims of creation op ``node`` the chunk dim could be: those ``num_chunks`` divides
    into chunks of at least one (an ``expand`` only along the dims it broadcasts)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return []
    n = num_chunks
    dims = [d for d, s in enumerate(val.shape) if int(s) % n == 0 and int(s) >= n]
    if node.target is aten.expand.default:
        src = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if not isinstance(src, torch.Tensor):
            return []
        lead = val.dim() - src.dim()  # new leading dims, then dims of size 1 broadcast
        dims = [d for d in dims if d < lead or int(src.shape[d - lead]) == 1]
    return dims


#: Arguments of the scatter family whose chunk dim ``self`` must share.
SCATTER_OPERANDS = ("index", "src", "source", "values")

_INDEX_PUTS = frozenset(
    {aten.index_put.default, aten.index_put_.default, aten._unsafe_index_put.default}
)


def check_index_put_values(node: torch.fx.Node, args: Any, kwargs: Any) -> None:
    """Raise as the real kernel does when ``index_put(self, indices, values)``'s ``values`` do
    not broadcast to the indexing result: torch's fake / meta ``index_put`` does not check it,
    so a full-size ``values`` next to chunk-sized ``self`` and indices would pass the probe and
    fail at run time (``shape mismatch: value tensor of shape [18, 8] cannot be broadcast to
    indexing result of shape [9, 8]``)."""
    if node.target not in _INDEX_PUTS or len(args) < 3:
        return
    self_t, indices, values = args[0], args[1], args[2]
    if not isinstance(self_t, torch.Tensor) or not isinstance(values, torch.Tensor):
        return
    result = aten.index.Tensor(self_t, list(indices))
    want, got = list(result.shape), list(values.shape)
    if len(got) > len(want):
        got = (
            got[len(got) - len(want) :] if all(s == 1 for s in got[: len(got) - len(want)]) else got
        )
    bad = len(got) > len(want) or any(
        isinstance(g, int) and isinstance(w, int) and g not in (1, w)
        for g, w in zip(reversed(got), reversed(want), strict=False)
    )
    if bad:
        raise RuntimeError(
            f"shape mismatch: value tensor of shape {list(values.shape)} cannot be broadcast "
            f"to indexing result of shape {list(result.shape)}"
        )
