"""Storage hazards: the order a graph that writes in place needs, kept through reordering.

Torch's bucket merge and its overlap scheduler order nodes by data edges alone, which is all an
Inductor post-grad graph (functional) needs -- except where a node writes a buffer in place and
another reads it with no data edge to the write. Two kinds of graph have such writes:

* torch's ``"custom_ops"`` bucket form unpacks a gathered bucket with
  ``split_with_sizes_copy.out(flat, sizes, out=[alias(empty_0), ...])`` and hands each member to
  its consumers as ``view(empty_i, shape)``: the consumers read ``empty_i`` with no edge to the
  copy that fills it (the scheduler hoisted the embedding lookup of a gathered weight above it:
  NaN losses);
* a joint graph traced without functionalization, as torchtitan's graph_trainer traces its
  train step (``make_fx`` of forward, loss and ``autograd.grad``): ``copy_`` into a slice of a
  buffer the backward later reads whole (its chunked loss writes each chunk's hidden-state
  gradient that way), ``add_`` accumulation, ``index_put_``. Reordering a reader of the buffer
  above the ``copy_`` read zeros: 44 of Llama3's 45 gradients were all zeros, the loss right.

:func:`hazard_edges` records, from the graph's order (the order that gives it its meaning),
every pair that must keep it: read-after-write, write-after-read and write-after-write on one
storage, where a storage is a node's output followed through every view and in-place op that
returns an alias of it (decided by the op's schema, never a list).
:func:`restore_order` re-sorts a reordered graph so every pair holds again, keeping the given
order wherever it already does; a pair that contradicts the data edges is a
:class:`HazardCycle`, and the caller restores the graph it was given.
:func:`written_storages` says which storages the graph writes in place, so a collective reading
one is kept out of buckets (a bucket's pack would read it at another time than the collective).
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Iterable, Iterator

import torch
import torch.fx as fx

from ap_bucketing import _compat

aten = torch.ops.aten


class HazardCycle(RuntimeError):
    """The storage-order pairs contradict the data edges of a reordered graph: no order keeps
    both (the graph is left as the reordering left it; the caller restores the original)."""


def _schema(node: fx.Node) -> torch.FunctionSchema | None:
    target = node.target
    if node.op != "call_function" or not isinstance(target, _compat.op_overload_type()):
        return None
    schema: torch.FunctionSchema = getattr(target, "_schema")  # noqa: B009 (a torch.ops overload)
    return schema


def is_view(node: fx.Node) -> bool:
    """``node``'s output shares its first argument's storage, so reading it reads the base: an
    op whose schema says it is a view (``view``, ``reshape``, ``slice``, ``t``, ``expand``,
    ``alias``, ...) or ``_unsafe_view`` (a view autograd does not track as one). Decided by
    the schema rather than a list, so a view op missing from a list can never let a read of
    an ``out=`` buffer slip above its write (ap-tags' ``aliases_input`` is the same rule;
    ``tests/test_vocabulary_agreement.py`` holds them together)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, _compat.op_overload_type()):
        return False
    return bool(getattr(target, "is_view", False)) or target is aten._unsafe_view.default


def _nodes_in(value: object) -> Iterator[fx.Node]:
    if isinstance(value, fx.Node):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _nodes_in(item)


def _argument_values(
    node: fx.Node, schema: torch.FunctionSchema
) -> Iterator[tuple[object, object]]:
    """``(schema argument, the value node passes for it)`` for every argument given."""
    for index, argument in enumerate(schema.arguments):
        if not argument.kwarg_only and index < len(node.args):
            yield argument, node.args[index]
        elif argument.name in node.kwargs:
            yield argument, node.kwargs[argument.name]


def written_inputs(node: fx.Node) -> list[fx.Node]:
    """The input nodes whose storage ``node`` writes: its schema's ``Tensor(a!)`` arguments
    (``self`` of ``add_`` / ``copy_``, an ``out=`` list)."""
    schema = _schema(node)
    if schema is None:
        return []
    written: list[fx.Node] = []
    for argument, value in _argument_values(node, schema):
        info = argument.alias_info  # type: ignore[attr-defined]
        if info is not None and info.is_write:
            written.extend(_nodes_in(value))
    return written


def aliased_input(node: fx.Node) -> fx.Node | None:
    """The input whose storage ``node``'s output shares, if any: a view, an in-place op that
    returns ``self``, a ``getitem`` of a multi-output view (``split``), ``_unsafe_view``, a
    collective's ``wait_tensor``."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        source = node.args[0]
        return source if isinstance(source, fx.Node) and aliased_input(source) else None
    if is_view(node) or node.target is _compat.wait_tensor_op():
        # a wait returns the very tensor its collective filled (its schema does not say so)
        first = node.args[0] if node.args else None
        return first if isinstance(first, fx.Node) else None
    schema = _schema(node)
    if schema is None:
        return None
    returned: set[str] = set()
    for ret in schema.returns:
        info = ret.alias_info
        if info is not None:
            returned |= set(info.before_set)
    if not returned:
        return None
    for argument, value in _argument_values(node, schema):
        info = argument.alias_info  # type: ignore[attr-defined]
        if info is not None and returned & set(info.before_set) and isinstance(value, fx.Node):
            return value
    return None


def storage_roots(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Every node -> the node whose output owns its storage (itself unless it aliases one)."""
    roots: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        source = aliased_input(node)
        roots[node] = roots.get(source, source) if source is not None else node
    return roots


def _accesses(node: fx.Node, roots: dict[fx.Node, fx.Node]) -> Iterator[tuple[fx.Node, bool]]:
    """``(storage, is_write)`` for each storage ``node`` reads or writes. Taking a view is not
    an access (the view's own readers are); a written input is a write."""
    written = {roots.get(n, n) for n in written_inputs(node)}
    for storage in written:
        yield storage, True
    source = aliased_input(node)
    view_of = roots.get(source, source) if source is not None and not written else None
    seen = set(written)
    for inp in node.all_input_nodes:
        storage = roots.get(inp, inp)
        if storage in seen or storage is view_of:
            continue
        seen.add(storage)
        yield storage, False


def written_storages(graph: fx.Graph) -> set[fx.Node]:
    """The storages (root nodes) some node of ``graph`` writes in place."""
    roots = storage_roots(graph)
    return {roots.get(n, n) for node in graph.nodes for n in written_inputs(node)}


def reads_written_storage(
    node: fx.Node, roots: dict[fx.Node, fx.Node], written: set[fx.Node]
) -> bool:
    """Whether ``node`` reads, through any input, a storage the graph writes in place."""
    return any(roots.get(inp, inp) in written for inp in node.all_input_nodes)


def hazard_edges(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node]]:
    """``(first, second)`` pairs of ``graph`` as ordered now that must stay in this order
    because they touch one storage and at least one writes it: each read after the last
    write before it, each write after every access since the previous write. Storages no
    node writes give none (a functional graph: no pairs)."""
    roots = storage_roots(graph)
    written = {roots.get(n, n) for node in graph.nodes for n in written_inputs(node)}
    if not written:
        return []
    last_write: dict[fx.Node, fx.Node] = {}
    reads_since: dict[fx.Node, list[fx.Node]] = {}
    edges: list[tuple[fx.Node, fx.Node]] = []
    for node in graph.nodes:
        for storage, is_write in _accesses(node, roots):
            if storage not in written:
                continue
            writer = last_write.get(storage)
            if writer is not None and writer is not node:
                edges.append((writer, node))
            if is_write:
                edges.extend((r, node) for r in reads_since.pop(storage, ()) if r is not node)
                last_write[storage] = node
            else:
                reads_since.setdefault(storage, []).append(node)
    return edges


def fill_edges(graph: fx.Graph, original: set[fx.Node]) -> list[tuple[fx.Node, fx.Node]]:
    """``(writer, reader)`` for each storage a bucket merge allocated (its root is not in
    ``original``) and fills in place: every read of it comes after every write, in
    whatever order the merge left them. Such a buffer is an uninitialised ``empty`` the
    ``"custom_ops"`` unpack copies a member into; no read of it can mean "before the copy",
    and torch's merge, sorting the bucket's region by data edges, leaves a consumer of an
    early member above the copy when the bucket spans the consumer (the embedding lookup of
    a model-wide bucket read uninitialised memory: NaN losses)."""
    roots = storage_roots(graph)
    writers: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        if node in original:
            continue
        for target in written_inputs(node):
            root = roots.get(target, target)
            if root not in original:
                writers.setdefault(root, []).append(node)
    if not writers:
        return []
    edges: list[tuple[fx.Node, fx.Node]] = []
    for node in graph.nodes:
        for storage, is_write in _accesses(node, roots):
            if not is_write:  # the writers fill disjoint parts (the copies of a bucket)
                edges.extend((writer, node) for writer in writers.get(storage, ()))
    return edges


def pull_up_fills(
    graph: fx.Graph, edges: Iterable[tuple[fx.Node, fx.Node]], original: set[fx.Node]
) -> int:
    """For each fill pair (``fill_edges``) whose reader the schedule put first, move the
    filling node and what the merge built to feed it (the wait, the views of the gathered
    buffer -- nodes not in ``original``) up to just before the reader; returns how many nodes
    moved.

    Torch's overlap scheduler sees no data edge from a bucket's unpack to the members'
    readers, so it leaves the unpack (and the wait before it) at the end of the graph; a
    restore that only moves readers down would then run the whole forward after every wait
    (every gathered weight alive at once). Moving the fill up instead keeps the readers where
    the scheduler put them. A fill whose inputs from the original graph are not all above
    the reader is left to ``restore_order``."""
    moved = 0
    pos = {n: i for i, n in enumerate(graph.nodes)}
    first_reader: dict[fx.Node, fx.Node] = {}
    for writer, reader in edges:
        if writer in pos and reader in pos and pos[reader] < pos[writer]:
            best = first_reader.get(writer)
            if best is None or pos[reader] < pos[best]:
                first_reader[writer] = reader
    for writer, reader in sorted(first_reader.items(), key=lambda e: pos[e[1]]):
        pos = {n: i for i, n in enumerate(graph.nodes)}
        if pos[writer] < pos[reader]:
            continue  # an earlier pull-up already brought it
        group: set[fx.Node] = set()
        stack = [writer]
        blocked = False
        while stack:
            node = stack.pop()
            if node in group:
                continue
            group.add(node)
            for inp in node.all_input_nodes:
                if pos[inp] < pos[reader]:
                    continue
                if inp in original or inp.op == "placeholder":
                    blocked = True
                    break
                stack.append(inp)
            if blocked:
                break
        if blocked:
            continue
        for node in sorted(group, key=pos.__getitem__):
            if pos[node] > pos[reader]:
                reader.prepend(node)
                moved += 1
    return moved


def sink_allocations(graph: fx.Graph, original: set[fx.Node]) -> int:
    """Move each allocation the bucket merge added (an input-less op such as the unpack's
    ``empty`` member buffers), with the views taken of it, down to just before its first
    reader; returns how many nodes moved.

    The overlap scheduler leaves input-less nodes where they are ready -- the top of the graph
    -- so every bucket's member buffers were allocated before the first matmul: a graph run
    in its order (graph_trainer's joint graph) held all gathered weights at once. Sinking keeps
    every data and write-order edge (a buffer and its views only precede their readers)."""
    moved = 0
    pos = {n: i for i, n in enumerate(graph.nodes)}
    for node in reversed(list(graph.nodes)):
        if node in original or node.op != "call_function" or not node.users:
            continue
        inputs = node.all_input_nodes
        if inputs and (
            not is_view(node) or written_inputs(node) or any(i in original for i in inputs)
        ):
            continue  # neither an allocation nor a plain view of a new one
        first = min(node.users, key=pos.__getitem__)
        if node.next is not first:
            first.prepend(node)
            moved += 1
            pos = {n: i for i, n in enumerate(graph.nodes)}
    return moved


def violated(graph: fx.Graph, edges: Iterable[tuple[fx.Node, fx.Node]]) -> int:
    """How many ``edges`` (of nodes still in ``graph``) the current order breaks."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    return sum(1 for a, b in edges if a in pos and b in pos and pos[a] > pos[b])


def restore_order(graph: fx.Graph, edges: Iterable[tuple[fx.Node, fx.Node]]) -> int:
    """Re-sort ``graph`` so that every ``(first, second)`` edge (of nodes still in it) has
    ``first`` first; returns how many nodes now sit at another position.

    A stable topological sort over data edges plus these edges, ties broken by the current
    position: where the current order already satisfies every edge nothing moves, and a node
    hoisted above a node it must follow moves down just far enough (with what depends on it).
    Raises :class:`HazardCycle`, the graph untouched, when no order satisfies both.
    """
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    extra: dict[fx.Node, list[fx.Node]] = {}
    broken = False
    for first, second in edges:
        if first in pos and second in pos and first is not second:
            extra.setdefault(first, []).append(second)
            broken = broken or pos[second] < pos[first]
    if not broken:
        return 0
    indegree = {n: len(n.all_input_nodes) for n in nodes}
    for seconds in extra.values():
        for second in seconds:
            indegree[second] += 1
    ready = [pos[n] for n in nodes if indegree[n] == 0]
    heapq.heapify(ready)
    order: list[fx.Node] = []
    while ready:
        node = nodes[heapq.heappop(ready)]
        order.append(node)
        for succ in (*node.users, *extra.get(node, ())):
            indegree[succ] -= 1
            if indegree[succ] == 0:
                heapq.heappush(ready, pos[succ])
    if len(order) != len(nodes):
        stuck = sorted((n for n in nodes if indegree[n] > 0), key=pos.__getitem__)
        raise HazardCycle(
            "the in-place write order of the graph forms a cycle with its data edges after "
            f"reordering, at node {stuck[0].name!r} ({stuck[0].format_node()})"
        )
    output = graph.output_node()
    for node in order:
        if node is not output:
            output.prepend(node)
    return sum(1 for i, n in enumerate(order) if pos[n] != i)


__all__ = [
    "HazardCycle",
    "aliased_input",
    "fill_edges",
    "hazard_edges",
    "is_view",
    "reads_written_storage",
    "pull_up_fills",
    "restore_order",
    "sink_allocations",
    "storage_roots",
    "violated",
    "written_inputs",
    "written_storages",
]
