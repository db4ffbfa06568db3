"""The reduce side of the copy-free bucket form: one cast for a coalesced bucket's shards.

With mixed precision reduced in low precision (gradients reduce-scattered in bf16, parameters
in fp32, as FSDP2 does with ``reduce_dtype=bf16``), every reduced shard is cast back to its
parameter's dtype after its wait: ``wait -> convert_element_type(fp32) -> output``. Inductor
makes each of those casts a kernel of its own -- it does not fuse pointwise nodes that share
no buffer -- so a block of nine parameters pays nine cast kernels a step, and a cold compile
builds one distinct kernel per shard shape (four on the kit: norm, attention, MLP, head).

A coalesced reduce-scatter's members complete together (one collective, one work), so their
casts lose nothing by running together: ``ap_bucketing::cast_shards`` casts them all in one
opaque multi-tensor copy (on CUDA one kernel, on CPU one call), and Inductor builds no kernel
for them. It is the mirror of the all-gather side's ``pack_shards``.

Only a cast whose every user is the graph's output is taken: a cast that feeds more compute
(a gradient scale, a clip) stays where it is, for Inductor to fuse with that compute.
"""

from __future__ import annotations

import functools
import logging
import operator
from typing import Any

import torch
import torch.fx as fx

from . import _compat

log = logging.getLogger(__name__)


@functools.cache
def cast_shards_op() -> Any:
    """``ap_bucketing::cast_shards(Tensor[] shards, ScalarType dtype) -> Tensor[]``: each shard
    cast to ``dtype`` into a fresh tensor of its own layout (registered on first use, as
    ``pack_shards`` is: making an ``OverlapBucketingPass`` of the coalesced form registers it,
    so code a warm cache serves finds it)."""

    @torch.library.custom_op("ap_bucketing::cast_shards", mutates_args=())
    def cast_shards(shards: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        outs = [torch.empty_like(s, dtype=dtype) for s in shards]
        # one multi-tensor copy (casting to ``dtype``), not a kernel per shard
        _compat.foreach_copy()(outs, list(shards))
        return outs

    @cast_shards.register_fake
    def _(shards: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        return [torch.empty_like(s, dtype=dtype) for s in shards]

    return torch.ops.ap_bucketing.cast_shards.default


def output_cast(wait: fx.Node) -> fx.Node | None:
    """The cast that is ``wait``'s only user and is read by the graph's output alone, else
    ``None``: what ``cast_shards`` may take over without delaying any compute that reads it."""
    if len(wait.users) != 1:
        return None
    (cast,) = wait.users
    if cast.target is not torch.ops.prims.convert_element_type.default:
        return None
    if cast.args[0] is not wait or len(cast.args) != 2 or cast.kwargs:
        return None
    if not cast.users or any(u.op != "output" for u in cast.users):
        return None
    return cast


def merge_shard_casts(graph: fx.Graph, waits: list[fx.Node]) -> int:
    """Replace the output casts of one coalesced reduce-scatter's ``waits`` by one
    ``cast_shards`` call per target dtype (where two or more share it); returns how many casts
    it took over.

    The call goes right before the output, the casts' only reader: every wait it reads is
    before it, and a cast Inductor would have delayed to the end is not pulled forward (each
    cast's fp32 shard is alive from the cast to the output, so its cast is as late as it can
    be; Inductor's peak-memory order moves such casts, and their waits, down there).
    """
    by_dtype: dict[torch.dtype, list[fx.Node]] = {}
    for wait in waits:
        cast = output_cast(wait)
        if cast is not None:
            dtype = cast.args[1]
            assert isinstance(dtype, torch.dtype), cast.format_node()
            by_dtype.setdefault(dtype, []).append(cast)
    (output,) = graph.find_nodes(op="output")
    taken = 0
    for dtype, casts in by_dtype.items():
        if len(casts) < 2:
            continue
        with graph.inserting_before(output):
            merged = graph.call_function(cast_shards_op(), ([c.args[0] for c in casts], dtype))
        merged.meta["val"] = [c.meta["val"] for c in casts]
        if "custom" in casts[-1].meta:
            merged.meta["custom"] = casts[-1].meta["custom"]
        anchor = merged
        for index, cast in enumerate(casts):
            with graph.inserting_after(anchor):
                out = graph.call_function(operator.getitem, (merged, index))
            out.meta.update({k: v for k, v in cast.meta.items() if k in ("val", "custom")})
            cast.replace_all_uses_with(out)
            graph.erase_node(cast)
            anchor = out
        taken += len(casts)
    if taken:
        log.debug("ap-bucketing: %d shard cast(s) of a coalesced reduce-scatter in one call", taken)
    return taken
