"""``bucket_collectives``: key-grouped, byte- and span-bounded greedy bucketing.

Drop-in for torch's ``greedy_bucket_collective_by_mb`` (same arguments, same result shape: a
list of buckets, each a list of >= 2 collective nodes in wait order). The rules
(``docs/architecture.md``, "Bucketing rules"):

* Collectives are grouped by key **without adjacency** (``non_adjacent=True``): a collective
  with another key between two equal-key ones in wait order does not split them, so graphs whose
  dp and tp collectives interleave still bucket. ``non_adjacent=False`` buckets runs of
  consecutive equal keys instead.
* A bucket closes on bytes (``max(in, out)`` from hint-safe sizes) **or** when its topological
  span (highest minus lowest rank, ranks snapshotted on entry) would exceed ``max_topo_span``:
  a long-span bucket lets the merge drag many layers of compute together.
* A collective that depends on a member of the open bucket never joins it; the check is
  incremental and bounded by rank (see ``_reach``), never a table of descendants per node.
* A collective whose size has no hint is left unbucketed with a warning, instead of guarding or
  crashing.
* With ``block_buckets`` (the default) the key also carries the collective's segment -- its
  transformer block and direction (``_blocks``) -- so a bucket never spans two blocks, and a
  bucket closes before a collective that gathers a parameter it already gathers. With
  ``backward_parts`` (the default) a backward collective's key carries its block's direct
  submodule too (attention, feed-forward), small parts (a norm) merged into a neighbour.

The function never mutates the graph.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, fields
from typing import Any

import torch.fx as fx

from . import _compat
from ._blocks import (
    block_context,
    block_of,
    collective_fqn,
    is_backward,
    part_of,
    source_placeholder,
)
from ._checks import require_callable, require_graph_module, require_mib
from ._config import BucketingConfig, resolve_config
from ._reach import BucketReach
from ._sizes import collective_bytes
from ._stats import BucketingStats, StatsObserver, publish

log = logging.getLogger(__name__)

_MIB = 1024 * 1024


@dataclass
class _Tally:
    """The counters of one invocation; every int field is the ``BucketingStats`` field of the
    same name."""

    buckets: list[list[fx.Node]] = field(default_factory=list)
    max_span: int = 0
    closed_by_bytes: int = 0
    closed_by_span: int = 0
    closed_by_repeat: int = 0
    skipped_dependent: int = 0
    skipped_unhinted: int = 0

    def stats(
        self, candidates: int, keys: int, max_topo_span: int | None, elapsed_s: float
    ) -> BucketingStats:
        counts = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "buckets"}
        counts.update(buckets=len(self.buckets), bucketed=sum(len(b) for b in self.buckets))
        counts.update(candidates=candidates, keys=keys, elapsed_s=elapsed_s)
        return BucketingStats(**counts, max_topo_span=max_topo_span)


def _candidates(
    graph: fx.Graph,
    filter_node: Callable[[fx.Node], bool],
    filter_wait_node: Callable[[fx.Node], bool] | None,
) -> tuple[dict[fx.Node, int], list[fx.Node], list[fx.Node]]:
    """Rank snapshot of every node, the nodes in rank order, and the eligible collectives in
    wait order (deduplicated: a collective with two waits is considered once)."""
    order: list[fx.Node] = list(graph.nodes)
    ranks: dict[fx.Node, int] = dict(zip(order, range(len(order)), strict=True))
    ordered: list[fx.Node] = []
    seen: set[fx.Node] = set()
    # find_nodes uses the graph's op/target index and returns nodes in graph order.
    for node in graph.find_nodes(op="call_function", target=_compat.wait_tensor_op()):
        if not node.args:
            continue
        coll = node.args[0]
        if not isinstance(coll, fx.Node) or coll in seen or not filter_node(coll):
            continue
        if filter_wait_node is not None and not filter_wait_node(node):
            continue
        seen.add(coll)
        ordered.append(coll)
    return ranks, order, ordered


def _key_of(key_fn: Callable[[fx.Node], Any], coll: fx.Node) -> Hashable:
    """``key_fn(coll)``; a key function that raises, or returns an unhashable key, fails naming
    itself and the collective (a ``TypeError`` for an unhashable key, else ``ValueError``)."""
    try:
        key: Hashable = key_fn(coll)
    except Exception as exc:
        raise ValueError(
            f"group key {getattr(key_fn, '__name__', key_fn)!r} failed on collective "
            f"{coll.name!r} (args={coll.args!r}): {type(exc).__name__}: {exc}"
        ) from exc
    try:
        hash(key)
    except TypeError as exc:
        raise TypeError(
            f"group key {getattr(key_fn, '__name__', key_fn)!r} returned an unhashable "
            f"{type(key).__name__} for collective {coll.name!r} (args={coll.args!r}): {exc}"
        ) from exc
    return key


#: a backward part holding less than this share of its block's bytes (of one key) joins a
#: neighbouring part's bucket: a norm's weight is not worth a collective of its own
_SMALL_PART = 1 / 8


def _group(
    ordered: list[fx.Node],
    key_fn: Callable[[fx.Node], Any],
    non_adjacent: bool,
    by_segment: bool = False,
    backward_parts: bool = False,
) -> list[list[fx.Node]]:
    """Split the candidates into independently bucketed lists: one per key (first-seen order)
    when ``non_adjacent``, else torch's runs of consecutive equal keys. ``by_segment``: the
    key also carries the collective's segment (block, direction); ``backward_parts``: a
    backward collective's also its part (``_blocks.part_of``), small parts merged
    (``_merge_small_parts``)."""

    context = block_context(ordered[0].graph) if by_segment and ordered else None
    # parts need the merge of small ones, which groups by key: torch's adjacent runs
    # (``non_adjacent=False``) keep block-wide backward buckets
    with_parts = by_segment and backward_parts and non_adjacent

    def key_of(coll: fx.Node) -> Hashable:
        key = _key_of(key_fn, coll)
        if not by_segment:
            return key
        fqn = collective_fqn(coll)
        block = None if fqn is None else block_of(fqn, context)
        backward = is_backward(coll)
        part = part_of(fqn, context) if with_parts and backward and fqn is not None else None
        return (key, (block, backward), part)

    if non_adjacent:
        by_key: dict[Hashable, list[fx.Node]] = {}
        for coll in ordered:
            by_key.setdefault(key_of(coll), []).append(coll)
        if with_parts:
            return _merge_small_parts(by_key, ordered)
        return list(by_key.values())
    runs: list[list[fx.Node]] = []
    last_key: object = object()
    for coll in ordered:
        key = key_of(coll)
        if runs and key == last_key:
            runs[-1].append(coll)
        else:
            runs.append([coll])
            last_key = key
    return runs


def _merge_small_parts(
    by_key: dict[Hashable, list[fx.Node]], ordered: list[fx.Node]
) -> list[list[fx.Node]]:
    """The groups of ``by_key`` (keys ``(key, segment, part)``) with every small part merged
    into the part before it in first-seen (wait) order, a small first part into the one after
    it. Small: one collective, or under ``_SMALL_PART`` of the segment's bytes. A norm's weight
    then rides with its sibling submodule's bucket instead of making a collective of its own,
    and a block whose weights are its direct children (``layers.0.w1``: every part one
    collective) stays one bucket, as without parts. Each group keeps ``ordered``'s (wait)
    order."""
    segments: dict[Hashable, list[list[fx.Node]]] = {}
    for full_key, members in by_key.items():
        assert isinstance(full_key, tuple) and len(full_key) == 3, full_key
        segments.setdefault(full_key[:2], []).append(members)
    out: list[list[fx.Node]] = []
    for parts in segments.values():
        sizes = [sum(collective_bytes(c) or 0 for c in part) for part in parts]
        total = sum(sizes)
        merged: list[list[fx.Node]] = []
        pending: list[fx.Node] = []  # small parts before the first large one
        for part, size in zip(parts, sizes, strict=True):
            if len(part) > 1 and size >= _SMALL_PART * total:
                merged.append(pending + part)
                pending = []
            elif merged:
                merged[-1] = merged[-1] + part
            else:
                pending = pending + part
        if pending:
            merged.append(pending)
        out.extend(merged)
    rank = {c: i for i, c in enumerate(ordered)}
    return [sorted(group, key=rank.__getitem__) for group in out]


def _bucket_one_group(
    members: list[fx.Node],
    ranks: dict[fx.Node, int],
    order: list[fx.Node],
    cap_mb: Callable[[int], float],
    max_topo_span: int | None,
    tally: _Tally,
    one_per_source: bool = False,
) -> None:
    """Greedy pass over one key's collectives (in wait order), appending buckets to ``tally``.
    ``one_per_source``: a collective whose source placeholder a member already has closes the
    bucket."""
    reach = BucketReach(ranks, order)
    sources: set[fx.Node] = set()
    bucket: list[fx.Node] = []
    bucket_bytes = 0
    low = high = 0
    bucket_index = 0
    cap = int(cap_mb(bucket_index) * _MIB)

    def close() -> None:
        nonlocal bucket, bucket_bytes, bucket_index, cap
        if len(bucket) > 1:
            tally.buckets.append(bucket)
            tally.max_span = max(tally.max_span, high - low)
        bucket = []
        bucket_bytes = 0
        sources.clear()
        reach.reset()
        bucket_index += 1
        cap = int(cap_mb(bucket_index) * _MIB)

    for coll in members:
        size = collective_bytes(coll)
        if size is None:
            tally.skipped_unhinted += 1
            log.warning(
                "ap_bucketing: leaving collective %r unbucketed: its size has no optimization "
                "hint (mark unbacked dims with hint_override=...)",
                coll.name,
            )
            continue
        rank = ranks[coll]
        source = source_placeholder(coll) if one_per_source else None
        if bucket:
            over_bytes = bucket_bytes + size > cap
            span = max(high, rank) - min(low, rank)
            over_span = max_topo_span is not None and span > max_topo_span
            repeat = source is not None and source in sources
            if over_bytes or over_span or repeat:
                tally.closed_by_bytes += int(over_bytes)
                tally.closed_by_span += int(over_span)
                tally.closed_by_repeat += int(repeat)
                close()
            elif reach.reaches(coll):
                tally.skipped_dependent += 1
                continue
        if not bucket:
            low = high = rank
        else:
            low, high = min(low, rank), max(high, rank)
        bucket.append(coll)
        bucket_bytes += size
        if source is not None:
            sources.add(source)
        reach.add_source(coll)
    if len(bucket) > 1:
        tally.buckets.append(bucket)
        tally.max_span = max(tally.max_span, high - low)


def bucket_collectives(
    gm: fx.GraphModule,
    cap_fn: Callable[[int], float],
    filter_node: Callable[[fx.Node], bool],
    group_key: Callable[[fx.Node], Any],
    filter_wait_node: Callable[[fx.Node], bool] | None = None,
    *,
    config: BucketingConfig | None = None,
    observer: StatsObserver | None = None,
) -> list[list[fx.Node]]:
    """Bucket the collectives of ``gm`` (same contract as torch's greedy bucketer).

    Args:
        gm: the graph module; not mutated.
        cap_fn: bucket index -> cap in MiB (ignored when ``config.bucket_cap_mb`` is set).
        filter_node: which collectives are candidates.
        group_key: only collectives with equal keys share a bucket.
        filter_wait_node: optional extra filter on the candidate's wait node.
        config: the rules; ``BucketingConfig()`` when omitted.
        observer: called with this invocation's ``BucketingStats`` (besides the global ones).

    Returns:
        Buckets of >= 2 collective nodes each, in wait order, keys in first-seen order.
    """
    where = "bucket_collectives"
    require_graph_module(gm, where=where, arg="gm")
    for name, fn in (("cap_fn", cap_fn), ("filter_node", filter_node), ("group_key", group_key)):
        require_callable(fn, where=where, arg=name)
    require_callable(filter_wait_node, where=where, arg="filter_wait_node", optional=True)
    require_callable(observer, where=where, arg="observer", optional=True)
    cfg = resolve_config(config, where=where)
    start = time.perf_counter()
    ranks, order, ordered = _candidates(gm.graph, filter_node, filter_wait_node)
    groups = _group(ordered, group_key, cfg.non_adjacent, cfg.block_buckets, cfg.backward_parts)
    fixed_cap = cfg.bucket_cap_mb

    def cap_mb(index: int) -> float:
        if fixed_cap is not None:
            return fixed_cap
        return require_mib(cap_fn(index), where=where, arg=f"cap_fn's result for bucket {index}")

    tally = _Tally()
    for members in groups:
        if len(members) > 1:
            _bucket_one_group(
                members, ranks, order, cap_mb, cfg.max_topo_span, tally, cfg.block_buckets
            )
    elapsed_s = time.perf_counter() - start
    publish(tally.stats(len(ordered), len(groups), cfg.max_topo_span, elapsed_s), observer)
    return tally.buckets
