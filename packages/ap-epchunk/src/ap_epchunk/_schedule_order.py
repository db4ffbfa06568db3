"""The pipelined order of one chunked region: a list scheduler over the region's span.

The span (``window``) is every graph node from the region's first body node to its last, body or
not; the new order is a permutation of it, so nothing outside moves and every node outside still
sees its inputs first. The scheduler only ever emits a node after all of its inputs in the window
(and after the nodes it must stay behind, :func:`order_edges`), so the order is a topological
order of the same graph: the values computed are the same, bit for bit.

Which ready node goes next (why):

1. a token-exchange launch (``all_to_all_single`` of the region's body): put the exchange on the
   wire as soon as its inputs exist, so that it runs while other work is emitted;
2. work that leads to an exchange launch (*feeding* work), lowest *stage* first (how many of
   the region's exchanges a node waits behind), then the chunk that runs first (forward:
   ``0 .. N-1``; backward: ``N-1 .. 0``, the order the autograd engine runs chunk backwards and
   the chunk pass sums their gradient partials in), then the original order;
3. otherwise the oldest in-flight launch's wait, if that exchange is estimated to be done
   (:mod:`ap_epchunk._schedule_cost`: a clock advanced by each emitted node's estimated cost)
   and an exchange of the region is still to be launched;
4. otherwise other ready work (*filler*: a shared expert, the tail of an earlier chunk), in the
   same order as 2 -- it runs while the exchange is still in flight;
5. otherwise that wait.

Rule 3 holds a wait back only while the pipeline fills and runs. In the *drain* (every exchange
of the region launched) nothing emitted later can hide the exchanges still in flight, so ready
filler always goes before a wait, whatever the estimate says: a wait emitted later than
necessary costs nothing (its dependents are emitted after it anyway), while filler emitted after
the last waits hides nothing. Measured on DeepSeek-V3 (one MoE layer, N=2), where the shared
experts and the router's tail otherwise ran after the first combine's wait
(``benchmarks/RESULTS.md``, issue 24).

For N chunks this is a pipeline: chunk ``c`` computes the stage after exchange ``k`` while the
exchanges ``k`` of chunks ``c+1 .. N-1`` are in flight, in forward and in backward alike, and
filler goes under the exchanges still in flight rather than under one that is already done (a
small token-count exchange).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch
import torch.fx
from ap_tags.graph import is_collective, is_wait

from ._plan import is_mutating
from ._schedule_cost import Clock
from ._schedule_regions import ChunkedRegion, ancestors_within, chunk_of, launch_of

_SEEDED = getattr(torch.Tag, "nondeterministic_seeded", None)

#: the drain rule (module doc); ``benchmarks.ep_overlap`` switches it off for its A/B
DRAIN_FILLER_FIRST = True


def chunk_rank(region: ChunkedRegion) -> dict[int, int]:
    """The position of each chunk in the pipeline (forward ascending, backward descending)."""
    indices = sorted(region.chunks)
    ordered = list(reversed(indices)) if region.backward else indices
    return {c: r for r, c in enumerate(ordered)}


def keeps_order(node: torch.fx.Node) -> bool:
    """Reordering two of these could change a value: a mutation, or a random op (which draws
    from the generator's state in call order)."""
    if node.op != "call_function":
        return False
    if is_mutating(node):
        return True
    tags = getattr(node.target, "tags", ())
    return _SEEDED is not None and _SEEDED in tags


def order_edges(window: Sequence[torch.fx.Node]) -> dict[torch.fx.Node, set[torch.fx.Node]]:
    """Extra ``node -> nodes it must stay behind``: mutations and random ops keep their relative
    order, and every other reader of a value a mutation writes stays on its side of it."""
    edges: dict[torch.fx.Node, set[torch.fx.Node]] = {}
    pos = {n: i for i, n in enumerate(window)}
    previous: torch.fx.Node | None = None
    for node in window:
        if not keeps_order(node):
            continue
        if previous is not None:
            edges.setdefault(node, set()).add(previous)
        previous = node
        if not is_mutating(node):
            continue
        for written in node.all_input_nodes:
            for reader in written.users:
                if reader is node or reader not in pos:
                    continue
                if pos[reader] < pos[node]:
                    edges.setdefault(node, set()).add(reader)
                else:
                    edges.setdefault(reader, set()).add(node)
    return edges


def stages(
    window: Sequence[torch.fx.Node], launches: set[torch.fx.Node]
) -> dict[torch.fx.Node, int]:
    """How many of the region's exchanges each window node waits behind (longest chain)."""
    inside = set(window)
    stage: dict[torch.fx.Node, int] = {}
    for node in window:
        deepest = max((stage[p] for p in node.all_input_nodes if p in inside), default=0)
        waits_exchange = is_wait(node) and any(p in launches for p in node.all_input_nodes)
        stage[node] = deepest + (1 if waits_exchange else 0)
    return stage


def pipeline_order(window: Sequence[torch.fx.Node], region: ChunkedRegion) -> list[torch.fx.Node]:
    """The window's nodes in pipelined order (see the module doc). Raises ``RuntimeError`` if
    the dependencies inside the window are cyclic (they never are in a valid graph)."""
    inside = set(window)
    pos = {n: i for i, n in enumerate(window)}
    launches = {x for c in region.chunks for x in region.exchanges(c)} & inside
    stage = stages(window, launches)
    feeds = ancestors_within(launches, inside)
    rank = chunk_rank(region)
    extra = order_edges(window)
    preds = {n: {p for p in n.all_input_nodes if p in inside} | extra.get(n, set()) for n in window}
    succs: dict[torch.fx.Node, list[torch.fx.Node]] = {n: [] for n in window}
    for n, ps in preds.items():
        for p in ps:
            succs[p].append(n)
    missing = {n: len(ps) for n, ps in preds.items()}
    clock = Clock()

    def work_key(node: torch.fx.Node) -> tuple[int, int, int]:
        chunk = chunk_of(node)
        r = rank.get(chunk, -1) if chunk is not None else -1
        return (stage[node], r, pos[node])

    # four ready queues: exchange launches, feeding work, waits (oldest launch first), filler
    launch_q: list[tuple[tuple[int, int, int], int]] = []
    feed_q: list[tuple[tuple[int, int, int], int]] = []
    wait_q: list[tuple[tuple[int, int], int]] = []
    fill_q: list[tuple[tuple[int, int, int], int]] = []
    by_pos = list(window)

    def push(node: torch.fx.Node) -> None:
        if node in launches:
            heapq.heappush(launch_q, (work_key(node), pos[node]))
        elif is_wait(node) and any(is_collective(p) for p in node.all_input_nodes):
            launch = launch_of(node)
            seq = clock.launched.get(launch, -1) if launch is not None else -1
            heapq.heappush(wait_q, ((seq, pos[node]), pos[node]))
        elif node in feeds:
            heapq.heappush(feed_q, (work_key(node), pos[node]))
        else:
            heapq.heappush(fill_q, (work_key(node), pos[node]))

    #: the region's exchanges not launched yet (0: the pipeline drains)
    unlaunched = [len(launches)]

    def pick() -> int:
        for queue in (launch_q, feed_q):
            if queue:
                return heapq.heappop(queue)[1]
        if wait_q:
            launch = launch_of(by_pos[wait_q[0][1]])
            draining = DRAIN_FILLER_FIRST and not unlaunched[0]
            if not fill_q or (not draining and clock.done(launch)):
                return heapq.heappop(wait_q)[1]
        return heapq.heappop(fill_q)[1]

    for node in window:
        if missing[node] == 0:
            push(node)
    order: list[torch.fx.Node] = []
    while launch_q or feed_q or wait_q or fill_q:
        node = by_pos[pick()]
        order.append(node)
        clock.emit(node)
        if node in launches:
            unlaunched[0] -= 1
        for s in succs[node]:
            missing[s] -= 1
            if missing[s] == 0:
                push(s)
    if len(order) != len(window):
        stuck = [n.name for n in window if missing[n] > 0][:5]
        raise RuntimeError(f"cyclic dependencies inside the region's span at {stuck}")
    return order
