"""``replayed_saves``: which nodes of a retraced joint graph hold what the first partition saved.

The second compilation retraces the first one's interpreted forward and backward graphs. Every
node traced while an interpreted node runs copies that node's tags, so the tags land on more
nodes than the values they describe, and sometimes on none:

* **Backward nodes.** AOTAutograd copies a forward node's ``custom`` onto the backward nodes
  that share its ``seq_nr``; in a retrace one ``seq_nr`` can cover the whole step, so every
  backward op inherits ``ap_must_save``. A backward node never holds a saved forward value.
* **Decompositions.** A tagged op the retrace decomposes (bf16 ``silu`` into an fp32 chain,
  ``native_layer_norm`` into ``var_mean`` + arithmetic) spreads its tag over every node of the
  chain; only the node producing the value is the saved value, not the intermediates.
* **Multi-output ops.** ``native_layer_norm`` saved outputs ``[1, 2]`` (mean, rstd); after
  decomposition those are a ``var_mean`` getitem and an ``rsqrt``: indices do not carry over.
* **No-op ops.** A tagged op the retrace traces to nothing (an ``_unsafe_view`` to the same
  shape) leaves its value on an untagged node.

All four are resolved by one fact of the retrace: the retraced backward *is* the first
compilation's backward graph, interpreted. The forward values it reads are therefore exactly
the retraced images of the values the first partition saved -- recomputations the first
partition chose happen inside that backward, from values it saved. So on a retrace (a graph
that carries save tags on forward nodes), the replay saves every forward value a backward node
reads: the node the backward reads, be it the tagged value itself, the ``detach`` AOTAutograd
hands a saved tensor over as, or the base of a tagged view. The tags then only explain:
tagged values whose storage the backward does not read are decomposition interiors or values
the second graph no longer needs (a backward op that took an argument it never used, such as
batch norm's running statistics), and read values without a tag lost it in the retrace. Both are
reported, neither is an error. One exception to "save what the backward reads": an untagged
constant (computed from no graph input at all, e.g. a ``scalar_tensor`` or an ``arange`` that
Inductor's joint-graph passes hoisted and share between forward and backward) is recomputed in
the backward for free, so it is not kept alive. Nor is a *tagged* constant unless AOTAutograd
marked it a forward node (``partitioner_tag`` ``is_forward``): the constants those passes
create in place of backward ops (``iota`` / ``scalar_tensor`` from the cross-entropy backward's
scatter) copy the save tag the backward node they replace inherited, but the first partition
never saw them (an HF causal LM computing its own loss replayed three such saves: two fp32
scalars and the int64 vocabulary ``iota``).

Saving fewer than the first partition is right only where the retraced backward does not read
a value, and then the replay says which. Every node traced while an interpreted node runs also
records that node in ``meta["from_node"]`` (torch's provenance, ``torch.fx.traceback``), so a
retraced forward node knows the *first partition's* name of the value it computes. ``dropped``
lists the first partition's saves (by their names there; ``parent[i]`` for a saved output of a
multi-output op) whose retraced values carry the save tag but none of which the backward reads
-- e.g. ``nll_loss_forward``'s ``total_weight`` with ``reduction="sum"``, an argument the first
backward took and never used. A first-partition save whose retrace computes nothing (a no-op
view) has no node to report it and needs none: its storage is another saved value's. Two cases
provenance cannot name are read off the first forward graph itself (``_unread_saves``): a saved
copy the retrace traces to no node at all, and a multi-output op's written-back outputs (batch
norm's running statistics) whose retraced nodes name the op, not the output. ``dropped_why``
says why each name is not kept.

"Backward" is decided by AOTAutograd's marks (``meta["autograd_backward"]``, every node traced
while autograd runs the backward) plus tangent reachability. A graph with no backward mark at
all (hand-built, or traced without provenance) cannot tell what the backward reads from what
it recomputes, so there the tags are taken as written: every tagged forward node, and of a
tagged multi-output op the getitems its index list names (all of them without a list). A graph
without any save tag is no replay: nothing is resolved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ._accessors import is_must_save, must_save_indices
from ._first_forward import interpreted_source
from ._unread_saves import named_drops
from .checks import require_graph
from .graph import (
    FORWARD_PARTITIONER_TAGS,
    backward_nodes,
    is_getitem,
    is_multi_output,
    op_overload,
    storage_base,
)


@dataclass(frozen=True)
class ReplayedSaves:
    """What ``replayed_saves`` found on a retraced joint graph.

    ``values``: forward nodes to save (getitems for multi-output ops), in graph order.
    ``not_read``: tagged forward nodes whose storage the backward does not read (decomposition
    interiors, values the retrace no longer needs) -- not saved. ``untagged_read``: forward
    nodes the backward reads that carry no tag (the tag was lost in the retrace) -- saved.
    ``backward_tagged``: backward nodes carrying save tags they inherited -- ignored.
    ``constants``: tagged constants a joint pass created -- recomputed, not saved.
    ``dropped``: the first partition's saves (its node names, ``parent[i]`` for a getitem)
    whose retraced values the backward does not read -- the storages the replay saves fewer.
    ``kept``: first-partition names of the values the replay saves (provenance, see
    ``first_partition_name``); empty on graphs without provenance. ``dropped_why``: why each
    of ``dropped`` is not kept (aligned with it; ``"<kind>: <detail>"``).
    """

    values: tuple[torch.fx.Node, ...]
    not_read: tuple[str, ...] = ()
    untagged_read: tuple[str, ...] = ()
    backward_tagged: tuple[str, ...] = ()
    constants: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    dropped_why: tuple[str, ...] = ()

    def notes(self) -> tuple[str, ...]:
        """One line per kind of tag the replay did not take as written (for reports)."""
        lines = (
            (self.not_read, "tagged forward values the backward does not read, not saved"),
            (self.untagged_read, "untagged forward values the backward reads, saved"),
            (self.backward_tagged, "backward nodes with inherited save tags, ignored"),
            (
                self.constants,
                "tagged constants the first partition never saw (created by the second "
                "compilation's joint passes, tag inherited from a backward node), recomputed "
                "in the backward instead of saved",
            ),
        )
        found = tuple(f"{len(names)} {what}: {_names(names)}" for names, what in lines if names)
        if not self.dropped:
            return found
        why = zip(self.dropped, self.dropped_why or ("",) * len(self.dropped), strict=True)
        each = [f"{name} ({reason})" if reason else name for name, reason in why]
        dropped = "; ".join(each[:8]) + (f"; ... ({len(each) - 8} more)" if len(each) > 8 else "")
        return (
            *found,
            f"{len(self.dropped)} first-partition saves the replay does not keep: {dropped}",
        )


def _names(names: tuple[str, ...], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _tagged(node: torch.fx.Node, backward: set[torch.fx.Node]) -> bool:
    """``node`` carries a save tag from the forward: its own, or (a getitem) its parent's."""
    if is_must_save(node):
        return True
    parent = node.args[0] if is_getitem(node) and node.args else None
    return isinstance(parent, torch.fx.Node) and parent not in backward and is_must_save(parent)


def _as_written(node: torch.fx.Node) -> bool:
    """Unmarked graphs: the tag as written (a getitem: its index is in the parent's list, or
    the parent has none)."""
    parent = node.args[0] if is_getitem(node) and node.args else None
    if not isinstance(parent, torch.fx.Node) or not is_multi_output(parent):
        return is_must_save(node)
    indices = must_save_indices(parent)
    return is_must_save(parent) and (not indices or node.args[1] in indices)


def _constants(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes computed from no graph input (only from other constants), deterministically."""
    found: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function" or _is_random(node):
            continue
        if all(i in found for i in node.all_input_nodes):
            found.add(node)
    return found


def _marked_forward(node: torch.fx.Node) -> bool:
    """AOTAutograd traced ``node`` as part of the forward (nodes a later pass creates carry no
    ``partitioner_tag``)."""
    return node.meta.get("partitioner_tag") in FORWARD_PARTITIONER_TAGS


def _is_random(node: torch.fx.Node) -> bool:
    op = op_overload(node)
    return op is not None and torch.Tag.nondeterministic_seeded in op.tags


def first_partition_name(node: torch.fx.Node) -> str | None:
    """The name of the interpreted node ``node`` was traced from, or None for a node no
    interpreted node produced (a constant a joint pass created).

    That is ``meta["from_node"]``'s nearest source recorded while an ``fx.Interpreter`` ran a
    node (``pass_name`` ``"Interpreter_<class>"``, or empty from a bare ``set_current_meta``);
    sources a named graph pass recorded (a pattern replacement) are followed through to theirs.
    """
    name = getattr(interpreted_source(node), "name", None)
    return name if isinstance(name, str) else None


def _saved_names(node: torch.fx.Node) -> list[str]:
    """The first-partition saves ``node``'s tag stands for: the source's name, or one
    ``source[i]`` per saved getitem index recorded on a multi-output source."""
    name = first_partition_name(node)
    if name is None:
        return []
    indices = must_save_indices(node)
    return [f"{name}[{i}]" for i in indices] if indices else [name]


def _kept(read: list[torch.fx.Node]) -> tuple[str, ...]:
    """First-partition names of the values the replay saves: a read value's, or its storage
    base's (the replay keeps that storage alive), in graph order."""
    kept: dict[str, None] = {}
    for node in read:
        for source in (node, storage_base(node)):
            name = first_partition_name(source)
            if name is not None:
                kept.setdefault(name)
    return tuple(kept)


_NOT_READ = "not read: its retraced values carry the save tag; the retraced backward reads none"


def _dropped(
    tagged: list[torch.fx.Node], kept: set[str], backward: set[torch.fx.Node]
) -> tuple[str, ...]:
    """First-partition saves none of whose retraced nodes the backward reads (see module doc):
    tagged forward nodes whose first-partition node is not ``kept``."""
    dropped: list[str] = []
    for node in tagged:
        if node in backward or first_partition_name(node) in kept:
            continue
        for name in _saved_names(node):
            if name not in dropped:
                dropped.append(name)
    return tuple(dropped)


def replayed_saves(graph: torch.fx.Graph | torch.fx.GraphModule) -> ReplayedSaves:
    """Resolve the first partition's save tags on a retraced joint graph (see module doc)."""
    g = require_graph(graph, where="replayed_saves")
    backward = backward_nodes(g)
    forward = [
        n
        for n in g.nodes
        if n.op == "call_function" and n not in backward and not is_multi_output(n)
    ]
    tagged = [n for n in forward if _tagged(n, backward)]
    backward_tagged = tuple(
        n.name for n in g.nodes if n in backward and n.op == "call_function" and is_must_save(n)
    )
    if not tagged:
        return ReplayedSaves((), backward_tagged=backward_tagged)
    if not any(n.meta.get("autograd_backward") is True for n in g.nodes):
        return ReplayedSaves(tuple(n for n in tagged if _as_written(n)))
    constant = _constants(g)
    tagged_set = set(tagged)
    read_all = [n for n in forward if any(user in backward for user in n.users)]
    hoisted = [n for n in read_all if n in constant and n in tagged_set and not _marked_forward(n)]
    read = [n for n in read_all if n not in constant or (n in tagged_set and _marked_forward(n))]
    read_storages = {storage_base(n) for n in read}
    kept = _kept(read)
    tagged_storages = {storage_base(n) for n in tagged}
    unread = _dropped([n for n in tagged if n not in constant], set(kept), backward)
    why = dict.fromkeys(unread, _NOT_READ)
    for drop in named_drops(g, backward, read):
        why.setdefault(drop.name, drop.why)
    return ReplayedSaves(
        values=tuple(read),
        not_read=tuple(n.name for n in tagged if storage_base(n) not in read_storages),
        untagged_read=tuple(n.name for n in read if storage_base(n) not in tagged_storages),
        backward_tagged=backward_tagged,
        constants=tuple(n.name for n in hoisted),
        dropped=tuple(why),
        kept=kept,
        dropped_why=tuple(why.values()),
    )
