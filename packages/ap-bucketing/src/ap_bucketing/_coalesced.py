"""The copy-free bucket form (``BucketingConfig(bucket_mode="coalesced")``): one coalesced
collective per bucket, each member gathered into (or reduced from) its own tensor.

torch's bucket forms move every bucket through one flat buffer: an all-gather bucket packs its
shards into the flat input, gathers into a flat output and copies each member back out
(``split_with_sizes_copy``: the gathered bytes once more, and the flat buffer alive beside the
member copies while it runs); a reduce-scatter bucket copies its unsharded gradients in
(``_chunk_cat``: the gradients once more) before reducing. On the H200 kit those copies were
about 5.7 GB of device traffic a step, and on CPU the flat buffer held a block's gathered bytes
twice at the unpack.

Here a bucket is one ``all_gather_into_tensor_coalesced`` / ``reduce_scatter_tensor_coalesced``
(NCCL groups the members in one launch; gloo and Inductor run them): no copy out, no copy in.
What remains is the all-gather's input side: the shards, cast to the gather dtype, are written
into one flat local buffer (``ap_bucketing::pack_shards``, one opaque op, so Inductor emits no
cast kernel per member) whose slices are the coalesced inputs -- the cast a gather needs
anyway, into one allocation of the local shard size.

The buckets are ap-bucketing's own (``bucket_collectives``: key-grouped, block-wide, byte- and
span-bounded, no dependent members) over the FSDP collectives of the FSDP groups; each merged
member keeps its wait where its old wait was (the coalesced collective issues where the bucket's
first member did, the reduce-scatter after its last gradient), so the graph's order means what
it meant. A member whose input is not available at the bucket's issue point stays unbucketed.
A reduce-scatter bucket's shards cast back to their parameters' dtype for the output are cast
in one call too (``ap_bucketing::cast_shards``, :mod:`._shard_casts`). A collective no bucket
takes keeps its own collective; a lone all-gather's cast goes through the pack, as a bucket of
one.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.fx as fx

from . import _compat
from ._config import BucketingConfig
from ._greedy import bucket_collectives
from ._shard_casts import merge_shard_casts
from ._sizes import hint_int

log = logging.getLogger(__name__)

_CASTS = ("convert_element_type", "_to_copy")
#: node meta a merged collective and its waits carry over from the nodes they replace
_META_KEYS = ("custom", "nn_module_stack", "autograd_backward", "partitioner_tag")


def _copy_meta(src: fx.Node, *dsts: fx.Node) -> None:
    for key in _META_KEYS:
        if key in src.meta:
            for dst in dsts:
                dst.meta[key] = src.meta[key]


@functools.cache
def _ops() -> dict[str, Any]:
    names = (
        "all_gather_into_tensor",
        "all_gather_into_tensor_coalesced",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced",
    )
    return dict(zip(names, _compat.c10d_ops(*names), strict=True))


@functools.cache
def pack_shards_op() -> Any:
    """``ap_bucketing::pack_shards(Tensor[] shards, ScalarType dtype) -> Tensor``: the shards
    cast to ``dtype`` and concatenated flat (registered on first use: importing ap-bucketing
    registers nothing; an ``OverlapBucketingPass`` of the coalesced form registers it when it
    is made, before any compile, so code a warm cache serves finds it)."""

    @torch.library.custom_op("ap_bucketing::pack_shards", mutates_args=())
    def pack_shards(shards: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        sizes = [s.numel() for s in shards]
        out = torch.empty(sum(sizes), dtype=dtype, device=shards[0].device)
        # one multi-tensor copy (casting to ``dtype``), not a kernel per shard
        _compat.foreach_copy()(list(torch.split(out, sizes)), [s.reshape(-1) for s in shards])
        return out

    @pack_shards.register_fake
    def _(shards: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return shards[0].new_empty((sum(s.numel() for s in shards),), dtype=dtype)

    return torch.ops.ap_bucketing.pack_shards.default


def _val(node: fx.Node) -> torch.Tensor:
    val = node.meta.get("val")
    assert isinstance(val, torch.Tensor), node.format_node()
    return val


def _group_key(node: fx.Node) -> Hashable:
    """What may share a coalesced collective: the op, its group, reduce op and dtype."""
    group_name = node.args[-1]
    extra = node.args[1] if node.target is _ops()["reduce_scatter_tensor"] else None
    return (node.target, str(group_name), extra, _val(node).dtype)


def _wait_of(coll: fx.Node) -> fx.Node | None:
    waits = [u for u in coll.users if u.target is _compat.wait_tensor_op()]
    return waits[0] if len(waits) == 1 else None


def _shard_source(ag: fx.Node) -> tuple[fx.Node, bool]:
    """What the pack reads for an all-gather's input: the tensor before a cast used only by
    this gather (the pack casts), else the input itself; and whether a cast was absorbed."""
    inp = ag.args[0]
    assert isinstance(inp, fx.Node)
    name = getattr(inp.target, "__name__", "").split(".")[0]
    if name in _CASTS and len(inp.users) == 1 and len(inp.all_input_nodes) == 1:
        return inp.all_input_nodes[0], True
    return inp, False


def _merge_all_gathers(graph: fx.Graph, bucket: list[fx.Node], pos: dict[fx.Node, int]) -> bool:
    first = min(bucket, key=pos.__getitem__)
    sources = [_shard_source(ag) for ag in bucket]
    if any(pos[src] >= pos[first] for src, _ in sources):
        return False
    group_size, group_name = first.args[1], first.args[2]
    dtype = _val(first).dtype
    shard_vals = [_val(src) for src, _ in sources]
    sizes = [hint_int(v.numel()) for v in shard_vals]
    if any(s is None for s in sizes):
        return False
    int_sizes = [int(s) for s in sizes if s is not None]
    fake = shard_vals[0]
    with graph.inserting_before(first):
        pack = graph.call_function(pack_shards_op(), ([src for src, _ in sources], dtype))
        pack.meta["val"] = fake.new_empty((sum(int_sizes),), dtype=dtype)
        split = graph.call_function(torch.ops.aten.split_with_sizes.default, (pack, int_sizes))
        split.meta["val"] = [pack.meta["val"].new_empty((s,)) for s in int_sizes]
        pieces = []
        for index in range(len(int_sizes)):
            piece = graph.call_function(operator.getitem, (split, index))
            piece.meta["val"] = split.meta["val"][index]
            pieces.append(piece)
        gathered_vals = [_val(ag) for ag in bucket]
        coll = graph.call_function(
            _ops()["all_gather_into_tensor_coalesced"], (pieces, group_size, group_name)
        )
        world = int(str(group_size))
        coll.meta["val"] = [pack.meta["val"].new_empty((world * s,)) for s in int_sizes]
        _copy_meta(first, pack, coll)
        outs = []
        for index in range(len(bucket)):
            out = graph.call_function(operator.getitem, (coll, index))
            out.meta["val"] = coll.meta["val"][index]
            outs.append(out)
    for index, ag in enumerate(bucket):
        old_wait = _wait_of(ag)
        assert old_wait is not None
        with graph.inserting_before(old_wait):
            wait = graph.call_function(_compat.wait_tensor_op(), (outs[index],))
            wait.meta["val"] = outs[index].meta["val"]
            full = graph.call_function(
                torch.ops.aten.view.default, (wait, list(gathered_vals[index].shape))
            )
            full.meta["val"] = gathered_vals[index]
            _copy_meta(old_wait, full, wait)
        old_wait.replace_all_uses_with(full)
        graph.erase_node(old_wait)
        cast = ag.args[0]
        graph.erase_node(ag)
        if sources[index][1] and isinstance(cast, fx.Node) and not cast.users:
            graph.erase_node(cast)
    return True


def _merge_reduce_scatters(graph: fx.Graph, bucket: list[fx.Node], pos: dict[fx.Node, int]) -> bool:
    inputs = [rs.args[0] for rs in bucket]
    if not all(isinstance(i, fx.Node) for i in inputs):
        return False
    last_input = max((i for i in inputs if isinstance(i, fx.Node)), key=pos.__getitem__)
    first = bucket[0]
    reduce_op, group_size, group_name = first.args[1], first.args[2], first.args[3]
    with graph.inserting_after(last_input):
        coll = graph.call_function(
            _ops()["reduce_scatter_tensor_coalesced"],
            (inputs, reduce_op, group_size, group_name),
        )
    coll.meta["val"] = [_val(rs) for rs in bucket]
    _copy_meta(first, coll)
    anchor = coll
    outs = []
    for index in range(len(bucket)):
        with graph.inserting_after(anchor):
            out = graph.call_function(operator.getitem, (coll, index))
        out.meta["val"] = coll.meta["val"][index]
        outs.append(out)
        anchor = out
    waits = []
    for index, rs in enumerate(bucket):
        old_wait = _wait_of(rs)
        assert old_wait is not None
        # the coalesced collective and its getitems sit right after the last input: an
        # original node after that input is after them too
        target = old_wait if pos[old_wait] > pos[last_input] else anchor.next
        with graph.inserting_before(target):
            wait = graph.call_function(_compat.wait_tensor_op(), (outs[index],))
        wait.meta.update(
            {k: v for k, v in old_wait.meta.items() if k in ("val", "custom", "nn_module_stack")}
        )
        old_wait.replace_all_uses_with(wait)
        graph.erase_node(old_wait)
        graph.erase_node(rs)
        waits.append(wait)
    merge_shard_casts(graph, waits)
    return True


def bucket_coalesced(
    gm: fx.GraphModule,
    config: BucketingConfig,
    groups: set[Hashable],
    cap_mb: Callable[[int], float],
    excluded: set[fx.Node],
) -> dict[str, int]:
    """Bucket the FSDP all-gathers and gradient reduce-scatters of ``groups`` in ``gm`` into
    coalesced collectives; returns how many buckets of each kind were merged."""
    is_fsdp_all_gather, group_name, _ = _compat.fsdp_all_gather_helpers()
    is_fsdp_rs_wait = _compat.fsdp_reduce_scatter_wait_predicate()

    def in_groups(node: fx.Node) -> bool:
        try:
            return node not in excluded and group_name(node) in groups
        except Exception:
            return False

    kinds: dict[str, tuple[Callable[[fx.Node], bool], Callable[[fx.Node], bool]]] = {
        "all_gather": (
            lambda n: n.target is _ops()["all_gather_into_tensor"] and in_groups(n),
            lambda w: bool(is_fsdp_all_gather(w.args[0])),
        ),
        "reduce_scatter": (
            lambda n: n.target is _ops()["reduce_scatter_tensor"] and in_groups(n),
            lambda w: bool(is_fsdp_rs_wait(w)),
        ),
    }
    merged = {}
    for kind, (filter_node, filter_wait) in kinds.items():
        buckets = bucket_collectives(
            gm, cap_mb, filter_node, _group_key, filter_wait, config=config
        )
        count = 0
        # merging inserts and erases nodes but moves none: the order of the nodes the buckets
        # refer to (collectives, their inputs and waits) stays the one numbered here
        pos = {n: i for i, n in enumerate(gm.graph.nodes)}
        for bucket in buckets:
            if any(_wait_of(c) is None for c in bucket):
                continue
            merge = _merge_all_gathers if kind == "all_gather" else _merge_reduce_scatters
            count += int(merge(gm.graph, bucket, pos))
        merged[kind] = count
        # an all-gather no bucket took (a block of one weight, the embedding, the head) keeps
        # its collective; its cast goes through the pack a bucket's does. A lone
        # reduce-scatter keeps its output cast: through ``cast_shards`` its wait went to the
        # graph's end with the cast, and its unsharded gradient with it (+0.5 MiB of the kit's
        # peak at dim 256 / 2 layers, the embedding's), where Inductor's own cast kernel waits
        # early
        if kind == "all_gather":
            for coll in _unbucketed(gm.graph, filter_node, filter_wait):
                _pack_single_all_gather(gm.graph, coll)
    _compat.stable_topological_sort(gm.graph)
    return merged


def _unbucketed(
    graph: fx.Graph, filter_node: Callable[[fx.Node], bool], filter_wait: Callable[[fx.Node], bool]
) -> list[fx.Node]:
    """The collectives the merge left as they were, each with its one wait."""
    found = []
    for node in graph.nodes:
        if node.op == "call_function" and filter_node(node):
            wait = _wait_of(node)
            if wait is not None and filter_wait(wait):
                found.append(node)
    return found


def _pack_single_all_gather(graph: fx.Graph, ag: fx.Node) -> bool:
    """An all-gather no bucket took, fed by a cast only it reads: the cast becomes
    ``pack_shards`` of the one shard (viewed back to its shape), as in a bucket.

    Inductor fuses such a cast into whatever kernel is nearest (the embedding's into the first
    norm, the head's into the last block's residual add), and each such fusion is a kernel
    source of its own -- one more C++ or Triton kernel for a cold compile to build, that no
    other layer shares. Through the opaque op those kernels are the ones every block has.
    """
    src, absorbed = _shard_source(ag)
    cast = ag.args[0]
    if not absorbed or not isinstance(cast, fx.Node):
        return False
    shard = _val(src)
    shape = list(shard.shape)
    if not all(isinstance(d, int) for d in shape):  # a symbolic shard keeps its cast
        return False
    dtype = _val(cast).dtype
    with graph.inserting_before(cast):
        pack = graph.call_function(pack_shards_op(), ([src], dtype))
        pack.meta["val"] = shard.new_empty((shard.numel(),), dtype=dtype)
        view = graph.call_function(torch.ops.aten.view.default, (pack, shape))
        view.meta["val"] = pack.meta["val"].view(shape)
    _copy_meta(cast, pack, view)
    ag.replace_input_with(cast, view)
    graph.erase_node(cast)
    return True


def cap_fn(config: BucketingConfig, group_size: int | None) -> Callable[[int], float]:
    """The byte cap per bucket in MiB: the config's, else torch's saturation model for the
    group's size (clamped as torch clamps it), else torch's 500 MiB."""
    if config.bucket_cap_mb is not None:
        fixed = config.bucket_cap_mb
        return lambda _index: fixed
    cap = _compat.pre_bucket_cap_mb(group_size)
    return lambda _index: cap
