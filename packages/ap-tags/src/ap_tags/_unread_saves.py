"""First-partition saves a replay has no storage for, named with the reason, from the first
forward graph itself (``_first_forward``).

Provenance alone (``_replay._dropped``) names a first-partition save whose retraced nodes the
backward never reads. Two cases escape it, and the first forward graph settles both without
guessing:

* **A copy with no image.** The first partition saved ``clone(x)`` (HF Phi-3: the contiguous
  copy of each attention output, saved for the output projection's weight gradient) and the
  retrace traces *no node at all* from it: the retraced backward reads ``x``'s storage through
  a view instead. A storage no retraced node computes is a storage the replay cannot keep, so
  the absence is the evidence; it is named when ``x``'s storage is one the replay does keep
  (the copy was redundant), with that as the reason.
* **A written-back output of a multi-output op.** Batch norm's ``_native_batch_norm_legit_
  functional`` returns the running statistics' new values (outputs 3 and 4), which the forward
  also returns for the runtime to copy into the buffers; the first backward took them as
  ``native_batch_norm_backward``'s ``running_mean``/``running_var`` and never read them in
  training. The retrace decomposes the op, so every node of it names the op, not the output.
  Output-precise evidence: the outputs the first forward writes back are exactly the op's
  retraced values the retrace ``copy_``-s into its inputs (same number, one each). When the
  backward reads none of those, every saved written-back output is named -- all of them or
  none, so no index is ever guessed.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from ._first_forward import (
    FirstForward,
    interpreted_source,
    output_name,
    registered_first_forward,
)
from .graph import is_getitem, is_multi_output, storage_base

aten = torch.ops.aten

#: First-partition ops whose value is a copy of their first argument (same data, own storage).
_COPY_OPS = (aten.clone.default,)


@dataclass(frozen=True)
class NamedDrop:
    """One first-partition save (its report name: node, or ``parent[i]``) the replay does not
    keep, and why (``"<kind>: <detail>"``)."""

    name: str
    why: str


def _sources(
    graph: torch.fx.Graph, backward: set[torch.fx.Node]
) -> dict[int, dict[torch.fx.Node, str]]:
    """Forward nodes of the retrace by the first graph they were traced from: ``{graph_id:
    {retraced node: first-partition node name}}``."""
    found: dict[int, dict[torch.fx.Node, str]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node in backward:
            continue
        source = interpreted_source(node)
        graph_id = getattr(source, "graph_id", None)
        if isinstance(graph_id, int):
            found.setdefault(graph_id, {})[node] = str(getattr(source, "name", ""))
    return found


def _kept_storage_name(
    node: torch.fx.Node, names: dict[torch.fx.Node, str], first: FirstForward
) -> str | None:
    """The first-partition report name of the storage a read retraced value lives in: its
    base's source, or ``source[i]`` when the base is output ``i`` of the same op the first
    partition ran (an op the retrace did not decompose keeps its output order). None when the
    retrace cannot say output-precisely (a decomposed multi-output op)."""
    base = storage_base(node)
    if is_getitem(base) and isinstance(base.args[0], torch.fx.Node):
        parent = base.args[0]
        source = names.get(parent)
        original = None if source is None else first.nodes.get(source)
        if original is None or original.target != parent.target:
            return None
        return f"{source}[{base.args[1]}]"
    source = names.get(base)
    original = None if source is None else first.nodes.get(source)
    if original is None or is_multi_output(original):
        return None
    return source


def _copies_without_image(
    first: FirstForward, names: dict[torch.fx.Node, str], read: Iterable[torch.fx.Node]
) -> list[NamedDrop]:
    """Saved storages of ``first`` that are a copy (``_COPY_OPS``) of a value whose storage the
    first partition saved too and the replay keeps, and from which the retrace traced no node
    (see module doc).

    Both partitions must hold the source's storage: only then is the copy redundant. When the
    first partition saved the copy *instead of* its source (HF Mixtral: a ``clone`` of the
    router's ``topk`` weights, the source unsaved) and the replay saves the source in its place,
    the replay keeps a storage of the same size for it: nothing is dropped, and naming the copy
    would misreport an exact replay."""
    imaged = set(names.values())
    kept = {k for r in read if (k := _kept_storage_name(r, names, first)) is not None}
    bases = list(dict.fromkeys(storage_base(v) for v in first.saved))
    first_saved = {output_name(b) for b in bases}
    drops: list[NamedDrop] = []
    for base in bases:
        if base.target not in _COPY_OPS or base.name in imaged:
            continue
        source = base.args[0] if base.args else None
        if not isinstance(source, torch.fx.Node):
            continue
        of = output_name(storage_base(source))
        if of in kept and of in first_saved:
            why = (
                f"no node in the retrace: a copy of {source.name} (storage {of}), which the "
                "replay keeps and the retraced backward reads instead"
            )
            drops.append(NamedDrop(base.name, why))
    return drops


def _copied_into_input(node: torch.fx.Node) -> bool:
    """``node`` is the source of a ``copy_`` into a graph input (an input's new value)."""
    return any(
        user.target is aten.copy_.default
        and len(user.args) >= 2
        and user.args[1] is node
        and isinstance(user.args[0], torch.fx.Node)
        and user.args[0].op == "placeholder"
        for user in node.users
    )


def _unread_write_backs(
    first: FirstForward, names: dict[torch.fx.Node, str], read: Iterable[torch.fx.Node]
) -> list[NamedDrop]:
    """Saved outputs of a multi-output op that the first forward also writes back to an input,
    when the retrace's written-back values of that op are as many and none is read by the
    backward (see module doc)."""
    written: dict[torch.fx.Node, list[tuple[Any, torch.fx.Node]]] = {}
    for value in first.written_back:
        if value.target is operator.getitem and isinstance(value.args[0], torch.fx.Node):
            written.setdefault(value.args[0], []).append((value.args[1], value))
    saved = set(first.saved)
    read_bases = {storage_base(r) for r in read}
    drops: list[NamedDrop] = []
    for parent, outputs in written.items():
        if not any(value in saved for _, value in outputs):
            continue
        copied = [n for n, name in names.items() if name == parent.name and _copied_into_input(n)]
        if len(copied) != len(outputs) or any(storage_base(n) in read_bases for n in copied):
            continue
        for index, value in outputs:
            if value in saved:
                why = (
                    f"written back, never read: the forward returns it as "
                    f"{first.written_back[value]} (an input's new value); the retraced backward "
                    "reads none of the op's written-back values"
                )
                drops.append(NamedDrop(f"{parent.name}[{index}]", why))
    return drops


def named_drops(
    graph: torch.fx.Graph, backward: set[torch.fx.Node], read: list[torch.fx.Node]
) -> tuple[NamedDrop, ...]:
    """First-partition saves the replay keeps no storage for, found against the registered
    first forward graphs the retrace came from (none registered: nothing found)."""
    drops: dict[str, NamedDrop] = {}
    for graph_id, names in _sources(graph, backward).items():
        first = registered_first_forward(graph_id)
        if first is None:
            continue
        for drop in [
            *_copies_without_image(first, names, read),
            *_unread_write_backs(first, names, read),
        ]:
            drops.setdefault(drop.name, drop)
    return tuple(drops.values())
