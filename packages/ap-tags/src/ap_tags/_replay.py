"""``replayed_saves``: which nodes of a retraced joint graph hold what the first partition saved.

The second compilation retraces the first one's interpreted forward and backward graphs. Every
node traced while an interpreted node runs copies that node's tags, so the tags land on more
nodes than the values they describe:

* **Backward nodes.** AOTAutograd copies a forward node's ``custom`` onto the backward nodes
  that share its ``seq_nr``; in a retrace one ``seq_nr`` can cover the whole step, so every
  backward op inherits ``ap_must_save``. A backward node never holds a saved forward value.
* **Decompositions.** A tagged op the retrace decomposes (bf16 ``silu`` into an fp32 chain,
  ``native_layer_norm`` into ``var_mean`` + arithmetic) spreads its tag over every node of the
  chain; only the node producing the value is the saved value, not the intermediates.
* **Multi-output ops.** ``native_layer_norm`` saved outputs ``[1, 2]`` (mean, rstd); after
  decomposition those are a ``var_mean`` getitem and an ``rsqrt``: indices do not carry over.

All three are resolved by one fact of the retrace: the retraced backward *is* the first
compilation's backward graph, interpreted, so the forward values it reads (directly, or through
the ``detach`` AOTAutograd puts on a saved tensor) are exactly the retraced images of the values
the first partition saved. A forward node is replayed as saved
when it carries a save tag (its own, or its multi-output parent's) **and** a backward node reads
it. Tagged forward nodes the backward does not read are decomposition interiors, or values the
second graph no longer needs (fused or merged by CSE): nothing is saved for them and they are
reported, never treated as an error.

"Backward" is decided by AOTAutograd's marks (``meta["autograd_backward"]``, every node traced
while autograd runs the backward) plus tangent reachability. A graph with no backward mark at
all (hand-built, or traced without provenance) cannot tell a decomposition interior from a
value, so there the tags are taken as written: every tagged forward node, and of a tagged
multi-output op the getitems its index list names (all of them without a list).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx

from ._accessors import is_must_save, must_save_indices
from .checks import require_graph
from .graph import aliases_input, backward_nodes, is_getitem, is_multi_output


@dataclass(frozen=True)
class ReplayedSaves:
    """What ``replayed_saves`` found on a retraced joint graph.

    ``values``: forward nodes to save (getitems for multi-output ops), in graph order.
    ``not_read``: tagged forward nodes the backward does not read (decomposition interiors,
    values the retrace no longer needs) -- not saved. ``backward_tagged``: backward nodes
    carrying save tags they inherited -- ignored.
    """

    values: tuple[torch.fx.Node, ...]
    not_read: tuple[str, ...]
    backward_tagged: tuple[str, ...]

    def notes(self) -> tuple[str, ...]:
        """One line per kind of tag the replay did not act on (for partition reports)."""
        out = []
        if self.not_read:
            out.append(
                f"{len(self.not_read)} tagged forward values are not read by the backward "
                f"(decomposition interiors or values the retrace no longer needs), not saved: "
                f"{_names(self.not_read)}"
            )
        if self.backward_tagged:
            out.append(
                f"{len(self.backward_tagged)} backward nodes carry save tags inherited from "
                f"their forward op, ignored: {_names(self.backward_tagged)}"
            )
        return tuple(out)


def _names(names: tuple[str, ...], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _tagged(node: torch.fx.Node, backward: set[torch.fx.Node]) -> bool:
    """``node`` carries a save tag from the forward: its own, or (a getitem) its parent's."""
    if is_must_save(node):
        return True
    parent = node.args[0] if is_getitem(node) and node.args else None
    return isinstance(parent, torch.fx.Node) and parent not in backward and is_must_save(parent)


def _read_by_backward(node: torch.fx.Node, backward: set[torch.fx.Node]) -> bool:
    """A backward node reads ``node``'s value: directly, or through forward aliases of it
    (AOTAutograd hands saved tensors over as ``detach(x)``, which the backward reads)."""
    stack, seen = [node], {node}
    while stack:
        current = stack.pop()
        for user in current.users:
            if user in backward:
                return True
            if user not in seen and aliases_input(user) and user.args[0] is current:
                seen.add(user)
                stack.append(user)
    return False


def _as_written(node: torch.fx.Node) -> bool:
    """Unmarked graphs: the tag as written (a getitem: its index is in the parent's list, or
    the parent has none)."""
    parent = node.args[0] if is_getitem(node) and node.args else None
    if not isinstance(parent, torch.fx.Node) or not is_multi_output(parent):
        return is_must_save(node)
    indices = must_save_indices(parent)
    return is_must_save(parent) and (not indices or node.args[1] in indices)


def replayed_saves(graph: torch.fx.Graph | torch.fx.GraphModule) -> ReplayedSaves:
    """Resolve the first partition's save tags on a retraced joint graph (see module doc)."""
    g = require_graph(graph, where="replayed_saves")
    backward = backward_nodes(g)
    marked = any(n.meta.get("autograd_backward") is True for n in g.nodes)
    values: list[torch.fx.Node] = []
    not_read: list[str] = []
    backward_tagged: list[str] = []
    for node in g.nodes:
        if node.op != "call_function" or not _tagged(node, backward):
            continue
        if node in backward:
            backward_tagged.append(node.name)
        elif is_multi_output(node):
            continue  # a tuple is never saved itself: its getitems are decided one by one
        elif _read_by_backward(node, backward) or (not marked and _as_written(node)):
            values.append(node)
        else:
            not_read.append(node.name)
    return ReplayedSaves(tuple(values), tuple(not_read), tuple(backward_tagged))
