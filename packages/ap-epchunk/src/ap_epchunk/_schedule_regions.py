"""What the overlap scheduler reads off a chunked graph, and the contract it holds regions to.

Everything comes from the metadata :func:`ap_epchunk.chunk_pass` stamps (``docs/architecture.md``,
"Tag schema"): a body copy carries ``custom["ap_chunk_region"]`` (its region root) and
``custom["ap_chunk_index"]`` (its chunk); split pieces and materializations also carry
``custom["ap_chunk_glue"]`` and are not body. The direction is ``ap_tags.graph.is_backward_node``.
No node name is read.

A region's *token exchanges* are its body's ``all_to_all_single`` launches. The contract a region
must meet to be scheduled (else it is left as it is, with the reason):

* chunks ``0 .. N-1`` all present, ``N >= 2``;
* every chunk runs the same exchanges in the same order: same count and, exchange by exchange,
  the same *signature* (process group, dtype, rank of the tensor);
* every exchange has a ``wait_tensor``;
* pairing exchange ``k`` of all chunks must not need a cycle: no chunk's exchange ``k`` may
  depend on another chunk's exchange ``k`` (or a later one) having completed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch.fx
from ap_tags import CHUNK_GLUE, CHUNK_INDEX, CHUNK_REGION, CUSTOM
from ap_tags.graph import is_backward_node, is_collective, is_wait, op_overload

from ._region_collectives import is_all_to_all

#: aten ops that only read metadata or bind scalars: never worth counting as hidden compute
_NOT_COMPUTE = frozenset(
    {
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "_assert_scalar",
        "_local_scalar_dense",
        "alias",
        "detach",
    }
)


@dataclass
class ChunkedRegion:
    """One chunked region of the graph: its body copies per chunk, in graph order."""

    root: str
    backward: bool
    chunks: dict[int, list[torch.fx.Node]] = field(default_factory=dict)

    @property
    def direction(self) -> str:
        return "backward" if self.backward else "forward"

    def body(self) -> list[torch.fx.Node]:
        return [n for i in sorted(self.chunks) for n in self.chunks[i]]

    def exchanges(self, chunk: int) -> list[torch.fx.Node]:
        """Chunk ``chunk``'s token exchanges (``all_to_all_single``), in graph order."""
        return [n for n in self.chunks[chunk] if is_all_to_all(n)]


def _custom(node: torch.fx.Node) -> dict[str, object]:
    custom = node.meta.get(CUSTOM)
    return custom if isinstance(custom, dict) else {}


def chunk_of(node: torch.fx.Node) -> int | None:
    """The chunk a body copy or glue piece belongs to (``ap_chunk_index``), else None."""
    index = _custom(node).get(CHUNK_INDEX)
    return index if isinstance(index, int) and not isinstance(index, bool) else None


def chunked_regions(graph: torch.fx.Graph) -> list[ChunkedRegion]:
    """The graph's chunked regions, ordered by their first body node."""
    regions: dict[tuple[str, bool], ChunkedRegion] = {}
    for node in graph.nodes:
        custom = _custom(node)
        root, index = custom.get(CHUNK_REGION), chunk_of(node)
        if not isinstance(root, str) or index is None or custom.get(CHUNK_GLUE):
            continue
        backward = is_backward_node(node)
        region = regions.setdefault((root, backward), ChunkedRegion(root, backward))
        region.chunks.setdefault(index, []).append(node)
    return list(regions.values())


def first_wait(launch: torch.fx.Node) -> torch.fx.Node | None:
    """The ``wait_tensor`` that completes a collective launch (its first, in graph order)."""
    waits = {u for u in launch.users if is_wait(u)}
    node = launch.next
    while waits and node.op != "root":
        if node in waits:
            return node
        node = node.next
    return None


def launch_of(wait: torch.fx.Node) -> torch.fx.Node | None:
    """The collective a wait (or a wait of a wait) completes."""
    node: torch.fx.Node | None = wait
    while node is not None and is_wait(node):
        inputs = node.all_input_nodes
        node = inputs[0] if inputs else None
    return node if node is not None and is_collective(node) else None


def exchange_signature(launch: torch.fx.Node) -> tuple[str, str, int]:
    """What two chunks' ``k``-th exchanges must agree on to be paired: the process group
    (the op's last argument), the dtype and the rank of the exchanged tensor."""
    group = str(launch.args[-1]) if launch.args else "?"
    val = launch.meta.get("val")
    dtype = str(getattr(val, "dtype", "?"))
    ndim = len(getattr(val, "shape", ()))
    return group, dtype, ndim


def is_compute(node: torch.fx.Node) -> bool:
    """A node that does work while an exchange is in flight: an aten op that is not a
    collective, a wait, a view, or a metadata / scalar read (what hides an exchange)."""
    op = op_overload(node)
    if op is None or is_collective(node) or is_wait(node):
        return False
    if getattr(op, "is_view", False):
        return False
    return str(op._schema.name).split("::")[-1] not in _NOT_COMPUTE


def _reach_within(
    start: Iterable[torch.fx.Node],
    window: set[torch.fx.Node],
    step: Callable[[torch.fx.Node], Iterable[torch.fx.Node]],
) -> set[torch.fx.Node]:
    """Every node of ``window`` reached from ``start`` by ``step`` (``start`` excluded unless
    reached again)."""
    seen: set[torch.fx.Node] = set()
    queue = deque(p for n in start for p in step(n) if p in window)
    while queue:
        node = queue.popleft()
        if node in seen:
            continue
        seen.add(node)
        queue.extend(p for p in step(node) if p in window and p not in seen)
    return seen


def ancestors_within(
    start: Iterable[torch.fx.Node], window: set[torch.fx.Node]
) -> set[torch.fx.Node]:
    """Every node of ``window`` that some node of ``start`` depends on (``start`` excluded)."""
    return _reach_within(start, window, lambda n: n.all_input_nodes)


def descendants_within(start: torch.fx.Node, window: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """Every node of ``window`` that depends on ``start`` (``start`` excluded)."""
    return _reach_within([start], window, lambda n: n.users)


def contract_violation(region: ChunkedRegion, window: set[torch.fx.Node]) -> str | None:
    """Why ``region`` cannot be scheduled (see the module doc), or None when it can."""
    indices = sorted(region.chunks)
    n = len(indices)
    if n < 2 or indices != list(range(n)):
        return f"chunks {indices} are not 0..N-1 with N >= 2"
    exchanges = {i: region.exchanges(i) for i in indices}
    signatures = {i: [exchange_signature(x) for x in exchanges[i]] for i in indices}
    for i in indices[1:]:
        if signatures[i] != signatures[0]:
            return (
                f"chunks disagree in their exchange signature: chunk 0 runs {signatures[0]}, "
                f"chunk {i} runs {signatures[i]}"
            )
    for i in indices:
        for x in exchanges[i]:
            if first_wait(x) is None:
                return f"exchange {x.name!r} of chunk {i} has no wait_tensor"
    for k in range(len(exchanges[0])):
        for i in indices:
            needed = ancestors_within([exchanges[i][k]], window)
            for j in indices:
                if j == i:
                    continue
                for later in exchanges[j][k:]:
                    wait = first_wait(later)
                    if wait in needed:
                        return (
                            f"pairing exchange {k} would need a cycle: {exchanges[i][k].name!r} "
                            f"(chunk {i}) depends on {later.name!r} (chunk {j}) completing"
                        )
    return None
