"""Tag FSDP all-gather chains so the backward re-gathers weights instead of saving them.

An FSDP chain is ``param placeholder -> casts -> all_gather_into_tensor -> wait -> views``.
Its outputs are full (unsharded) weights: saving any of them for backward keeps a whole layer's
weights alive across the forward, which is exactly what resharding after forward forbids.
This pass

* tags the whole single-input chain between the placeholder and the all-gather (any number of
  casts, ``_to_copy`` or ``convert_element_type``), not only one immediate cast;
* follows fan-out after the wait: every single-input consumer branch is part of the chain, up to
  the first multi-input consumer (e.g. the ``mm`` that uses the weight);
* checks only the all-gather's *tensor* argument, so a process group passed as an FX node does
  not make a real FSDP gather look multi-input;
* understands 2.15's ``wait_tensors([ag]) -> getitem`` as well as ``wait_tensor(ag)``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.fx

from ._accessors import set_recompute
from ._compat import checkpoint_policy, functional_collective_ops
from ._keys import FSDP_AC_GRAPH_ID
from .checks import require_bool, require_graph
from .graph import aliases_input, is_backward_node, is_getitem

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FsdpChain:
    """One detected FSDP all-gather chain (node names, in graph order within each part)."""

    placeholder: str
    casts: tuple[str, ...]
    all_gather: str
    wait: tuple[str, ...]
    views: tuple[str, ...]
    tagged: tuple[str, ...]


@dataclass(frozen=True)
class FsdpTagReport:
    """What ``mark_fsdp_all_gather_recomputation`` found and wrote."""

    reshard_after_forward: bool
    chains: tuple[FsdpChain, ...] = ()
    skipped_all_gathers: tuple[str, ...] = ()
    tagged_nodes: tuple[str, ...] = field(default=())

    @property
    def chains_found(self) -> int:
        return len(self.chains)

    @property
    def nodes_tagged(self) -> int:
        return len(self.tagged_nodes)


def _free_to_recompute(node: torch.fx.Node) -> bool:
    """Ops that only re-describe a value (aliases, getitems, ``reshape``): never worth saving on
    their own, so ``reshard_after_forward=False`` saves the op before them instead."""
    return is_getitem(node) or aliases_input(node) or node.target is torch.ops.aten.reshape.default


def _cast_chain_to_placeholder(
    all_gather: torch.fx.Node,
) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """Walk up from the all-gather's tensor input through single-input ops to a placeholder.

    Returns ``(placeholder, chain_nodes_in_graph_order)`` or None when the input depends on
    more than one node (or on no placeholder at all), i.e. the gather is not an FSDP gather.
    """
    current = all_gather.args[0] if all_gather.args else None
    chain: list[torch.fx.Node] = []
    while isinstance(current, torch.fx.Node):
        if current.op == "placeholder":
            chain.reverse()
            return current, chain
        if current.op != "call_function" or len(current.all_input_nodes) != 1:
            return None
        chain.append(current)
        current = current.all_input_nodes[0]
    return None


def _wait_of(
    all_gather: torch.fx.Node, wait_op: object, wait_many_op: object | None
) -> list[torch.fx.Node] | None:
    """The node(s) that make the gathered value usable: ``[wait]`` or ``[wait_tensors, getitem]``.

    A ``wait_tensors`` that also waits on other collectives is not tagged (recomputing it would
    drag those collectives into the backward), so such a gather is not treated as a chain.
    """
    for user in all_gather.users:
        if user.op != "call_function":
            continue
        if user.target is wait_op:
            return [user]
        if wait_many_op is not None and user.target is wait_many_op:
            tensors = user.args[0]
            if not isinstance(tensors, list | tuple) or len(tensors) != 1:
                return None
            getitems = [u for u in user.users if is_getitem(u)]
            return [user, *getitems]
    return None


def _view_fanout(start: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """Single-input forward consumers reachable from ``start``, across fan-out (BFS, dedup)."""
    seen: set[torch.fx.Node] = set(start)
    out: list[torch.fx.Node] = []
    frontier = list(start)
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in seen or user.op != "call_function" or is_backward_node(user):
                continue
            if len(user.all_input_nodes) != 1:
                continue  # the first multi-input consumer ends this branch
            seen.add(user)
            out.append(user)
            frontier.append(user)
    return out


def _last_non_view_nodes(
    chain_ends: list[torch.fx.Node], chain: set[torch.fx.Node]
) -> list[torch.fx.Node]:
    """For each branch end, walk back through view-like ops to the last real producer."""
    picked: list[torch.fx.Node] = []
    for end in chain_ends:
        node = end
        while (
            _free_to_recompute(node) and node.all_input_nodes and node.all_input_nodes[0] in chain
        ):
            node = node.all_input_nodes[0]
        if node not in picked:
            picked.append(node)
    return picked


def _branch_ends(chain: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """Chain nodes none of whose users continue the chain (where the weight leaves it)."""
    members = set(chain)
    return [n for n in chain if not any(u in members for u in n.users)]


def is_fsdp_chain_all_gather(node: torch.fx.Node) -> bool:
    """``node`` is an all-gather that :func:`mark_fsdp_all_gather_recomputation` finds as an
    FSDP chain, whatever its tags: an ``all_gather_into_tensor`` of a placeholder (a parameter
    shard) or of a chain of single-input ops (casts) from one, completed by a wait of its own
    (``wait_tensor``, or a ``wait_tensors`` of it alone). Reads the graph only."""
    all_gather_op, wait_op, wait_many_op = functional_collective_ops()
    return (
        node.op == "call_function"
        and node.target is all_gather_op
        and _cast_chain_to_placeholder(node) is not None
        and bool(_wait_of(node, wait_op, wait_many_op))
    )


def mark_fsdp_all_gather_recomputation(
    graph: torch.fx.Graph | torch.fx.GraphModule, reshard_after_forward: bool = True
) -> FsdpTagReport:
    """Tag every FSDP all-gather chain in a joint (or forward) graph.

    ``reshard_after_forward=True``: every chain node except the placeholder gets
    ``recompute=MUST_RECOMPUTE`` and ``ac_graph_id=FSDP_AC_GRAPH_ID`` (one shared large id, so
    torch's ``cleanup_recompute_tags`` never turns a chain node into a region boundary save).
    ``False``: the last non-view node of each branch gets ``MUST_SAVE`` (the gathered weight
    stays alive, so the backward does not gather it again).
    """
    require_bool(
        reshard_after_forward,
        where="mark_fsdp_all_gather_recomputation",
        arg="reshard_after_forward",
    )
    g = require_graph(graph, where="mark_fsdp_all_gather_recomputation")
    all_gather_op, wait_op, wait_many_op = functional_collective_ops()
    policy = checkpoint_policy()

    planned: list[tuple[FsdpChain, list[torch.fx.Node]]] = []
    skipped: list[str] = []
    for node in g.find_nodes(op="call_function", target=all_gather_op):
        upstream = _cast_chain_to_placeholder(node)
        waits = _wait_of(node, wait_op, wait_many_op)
        if upstream is None or not waits:
            skipped.append(node.name)
            log.debug("all-gather %s is not an FSDP chain; left untouched", node.name)
            continue
        placeholder, casts = upstream
        views = _view_fanout(waits)
        chain = [*casts, node, *waits, *views]
        if reshard_after_forward:
            to_tag = chain
        else:
            to_tag = _last_non_view_nodes(_branch_ends([*waits, *views]), set(chain))
        planned.append(
            (
                FsdpChain(
                    placeholder=placeholder.name,
                    casts=tuple(n.name for n in casts),
                    all_gather=node.name,
                    wait=tuple(n.name for n in waits),
                    views=tuple(n.name for n in views),
                    tagged=tuple(n.name for n in to_tag),
                ),
                to_tag,
            )
        )

    chosen = policy.MUST_RECOMPUTE if reshard_after_forward else policy.MUST_SAVE
    tagged: list[str] = []
    for _, nodes in planned:
        for n in nodes:
            set_recompute(n, chosen, FSDP_AC_GRAPH_ID)
            if n.name not in tagged:
                tagged.append(n.name)
    report = FsdpTagReport(
        reshard_after_forward=reshard_after_forward,
        chains=tuple(c for c, _ in planned),
        skipped_all_gathers=tuple(skipped),
        tagged_nodes=tuple(tagged),
    )
    log.info(
        "FSDP tagging: %d chains, %d nodes tagged %s, %d all-gathers skipped",
        report.chains_found,
        report.nodes_tagged,
        chosen.name,
        len(skipped),
    )
    return report
