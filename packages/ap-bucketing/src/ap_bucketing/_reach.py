"""Incremental "does this candidate depend on the open bucket?" checks in near-linear time.

No descendant set is built, neither per bucket nor per node (one per node is O(N^2) memory on
large graphs). Two cheap checks answer instead, both relying on the graph being topologically
sorted (a path from a member to a candidate only runs through nodes ranked between the two):

1. A short backward walk from the candidate that stops at placeholders, constants and anything
   ranked below the bucket's lowest member. FSDP all-gathers (parameter -> cast -> gather)
   settle here in O(1).
2. Otherwise a forward sweep over the rank window, propagating "reached from a member" through
   ``node.users``. The sweep position only moves forward within a bucket and restarts at the next
   bucket's first member, so each key's pass scans each node about once: O(N + E) per key.

Memory is O(window), never O(N^2).
"""

from __future__ import annotations

import torch.fx as fx

_QUICK_LIMIT = 16
_LEAF_OPS = frozenset({"placeholder", "get_attr"})


class BucketReach:
    """Forward reachability from a growing set of source nodes (the open bucket's members)."""

    def __init__(self, ranks: dict[fx.Node, int], order: list[fx.Node]) -> None:
        self._ranks = ranks
        self._order = order
        self._sources: set[fx.Node] = set()
        self._reached: set[fx.Node] = set()
        self._low = 0
        self._pos: int | None = None

    def reset(self) -> None:
        """Forget all sources (the bucket was closed)."""
        self._sources.clear()
        self._reached.clear()
        self._pos = None

    def add_source(self, node: fx.Node) -> None:
        """Make ``node`` a member: everything downstream of it now counts as dependent."""
        rank = self._ranks[node]
        self._sources.add(node)
        if self._pos is None:
            self._pos = self._low = rank
            return
        self._low = min(self._low, rank)
        if rank < self._pos:  # the sweep already passed it: propagate up to the sweep position
            self._propagate_below(node, self._pos)

    def _propagate_below(self, start: fx.Node, limit: int) -> None:
        stack = [start]
        while stack:
            node = stack.pop()
            for user in node.users:
                if user not in self._reached:
                    self._reached.add(user)
                    if self._ranks.get(user, limit) < limit:
                        stack.append(user)

    def _quick_verdict(self, candidate: fx.Node) -> bool | None:
        """True/False if a short backward walk decides dependence, None if it gave up."""
        stack = list(candidate.all_input_nodes)
        seen: set[fx.Node] = set()
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if node in self._sources or node in self._reached:
                return True
            if node.op in _LEAF_OPS or self._ranks.get(node, -1) < self._low:
                continue
            if len(seen) > _QUICK_LIMIT:
                return None
            stack.extend(node.all_input_nodes)
        return False

    def reaches(self, candidate: fx.Node) -> bool:
        """True iff ``candidate`` is a strict descendant of some member."""
        if self._pos is None:
            return False
        quick = self._quick_verdict(candidate)
        if quick is not None:
            return quick
        limit = self._ranks[candidate]
        order, sources, reached = self._order, self._sources, self._reached
        pos = self._pos
        while pos < limit:
            node = order[pos]
            pos += 1
            if node in sources or node in reached:
                for user in node.users:
                    reached.add(user)
        self._pos = max(pos, self._pos)
        return candidate in reached
