"""Incremental "does this candidate depend on the open bucket?" checks in near-linear time.

Torch's upstream greedy bucketer grows a full descendant set per bucket, and the reference patch
precomputed descendant sets for *every* node (O(N^2) memory on large graphs). Here reachability
is explored lazily from the bucket's members, in topological-rank order, and only as far as the
candidate being asked about: in a topologically sorted graph every path from a member to a
candidate runs through nodes ranked below the candidate, so nothing beyond that rank needs to
be visited. Each node is expanded at most once per bucket, and consecutive buckets of one key
explore adjacent rank windows, so a whole bucketing pass stays O((N + E) log N) per key.
"""

from __future__ import annotations

import heapq

import torch.fx as fx


class BucketReach:
    """Forward reachability from a growing set of source nodes (the open bucket's members)."""

    def __init__(self, ranks: dict[fx.Node, int]) -> None:
        self._ranks = ranks
        self._reached: set[fx.Node] = set()
        self._frontier: list[tuple[int, int, fx.Node]] = []
        self._tiebreak = 0

    def reset(self) -> None:
        """Forget all sources (the bucket was closed)."""
        self._reached.clear()
        self._frontier.clear()

    def add_source(self, node: fx.Node) -> None:
        """Make ``node`` a source: everything downstream of it now counts as dependent."""
        self._push(node)

    def _push(self, node: fx.Node) -> None:
        rank = self._ranks.get(node)
        if rank is None:  # created after the rank snapshot; nothing can be behind it
            return
        self._tiebreak += 1
        heapq.heappush(self._frontier, (rank, self._tiebreak, node))

    def reaches(self, candidate: fx.Node) -> bool:
        """True iff ``candidate`` is a strict descendant of some source."""
        limit = self._ranks[candidate]
        frontier = self._frontier
        reached = self._reached
        while frontier and frontier[0][0] < limit:
            _, _, node = heapq.heappop(frontier)
            for user in node.users:
                if user not in reached:
                    reached.add(user)
                    self._push(user)
        return candidate in reached
