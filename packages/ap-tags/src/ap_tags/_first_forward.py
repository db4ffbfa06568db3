"""The first partition's forward graphs, found again from a retraced node's provenance.

The second compilation retraces the first one's forward graph through an ``fx.Interpreter``;
every node traced while an interpreted node runs records it in ``meta["from_node"]`` (torch's
``NodeSource``: the interpreted node's name and ``id`` of its graph). Names alone cannot say
what the replay saves fewer where the retrace traces a first-partition save to no node at all
(a contiguous ``clone`` the retrace does not need) or to nodes of a decomposed multi-output op
(which of its outputs a node is). The first forward graph can: ``preserve_meta_compiler``
registers each forward graph it interprets here (weakly: the interpreted callable owns it), and
``first_forward_of`` finds it again by the ``graph_id`` a retraced node's provenance carries.
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from ._compat import input_mutation_output_type
from ._saved import saved_positions_from_descriptors

__all__ = [
    "FirstForward",
    "interpreted_source",
    "output_name",
    "register_first_forward",
    "registered_first_forward",
]

_GRAPHS: weakref.WeakValueDictionary[int, torch.fx.Graph] = weakref.WeakValueDictionary()


def register_first_forward(graph: torch.fx.Graph) -> None:
    """Remember ``graph`` (a first-partition forward graph about to be interpreted) so that a
    retrace of it can be read against it; held weakly, by ``id`` as ``NodeSource`` records."""
    _GRAPHS[id(graph)] = graph


def interpreted_source(node: torch.fx.Node) -> Any | None:
    """The ``NodeSource`` of the interpreted node ``node`` was traced from, or None.

    That is ``meta["from_node"]``'s nearest source recorded while an ``fx.Interpreter`` ran a
    node (``pass_name`` ``"Interpreter_<class>"``, or empty from a bare ``set_current_meta``);
    sources a named graph pass recorded (a pattern replacement) are followed through to theirs.
    """
    sources = node.meta.get("from_node")
    while isinstance(sources, list) and sources:
        source = sources[-1]
        name = getattr(source, "name", None)
        pass_name = getattr(source, "pass_name", None)
        interpreted = pass_name == "" or (
            isinstance(pass_name, str) and pass_name.startswith("Interpreter_")
        )
        if interpreted and isinstance(name, str):
            return source
        sources = getattr(source, "from_node", None)
    return None


@dataclass(frozen=True)
class FirstForward:
    """A registered first-partition forward graph, read for what the replay needs.

    ``saved``: the computed values the partition saved for backward (output order, inputs
    excluded). ``written_back``: forward outputs that are an input's new value (a buffer
    update the runtime copies back), each with the input it updates (descriptor text).
    ``nodes``: every node by name."""

    graph: torch.fx.Graph
    saved: tuple[torch.fx.Node, ...]
    written_back: dict[torch.fx.Node, str]
    nodes: dict[str, torch.fx.Node]


def _read(graph: torch.fx.Graph) -> FirstForward | None:
    """``graph``'s saved and written-back outputs from its output descriptors; None when the
    descriptors cannot tell them apart (then nothing is concluded from this graph)."""
    out = graph.output_node()
    values = out.args[0] if isinstance(out.args[0], list | tuple) else [out.args[0]]
    positions = saved_positions_from_descriptors(out, len(values))
    if positions is None:
        return None
    saved = tuple(
        v
        for p in positions
        if isinstance(v := values[p], torch.fx.Node) and v.op == "call_function"
    )
    mutation = input_mutation_output_type()
    written: dict[torch.fx.Node, str] = {}
    for value, desc in zip(values, out.meta.get("desc") or (), strict=False):
        if mutation is not None and isinstance(desc, mutation) and isinstance(value, torch.fx.Node):
            expr = getattr(desc, "expr", None)
            written[value] = expr() if callable(expr) else str(desc)
    return FirstForward(graph, saved, written, {n.name: n for n in graph.nodes})


def registered_first_forward(graph_id: int) -> FirstForward | None:
    """The registered first forward graph with this ``id`` (a ``NodeSource.graph_id``), read
    (``FirstForward``); None when none is registered or its descriptors cannot tell saved
    outputs apart."""
    graph = _GRAPHS.get(graph_id)
    return None if graph is None else _read(graph)


def output_name(node: torch.fx.Node) -> str:
    """How reports name one saved storage: the node's name, or ``parent[i]`` for an output of
    a multi-output op (a getitem is no op of its own)."""
    parent = node.args[0] if node.target is operator.getitem and node.args else None
    if isinstance(parent, torch.fx.Node):
        return f"{parent.name}[{node.args[1]}]"
    return node.name
