"""``tag_saved_outputs``: stamp the first partition's save decisions onto forward nodes.

AOTAutograd's forward graph returns ``[user-visible outputs | values saved for backward]``.
Only the second part is a save decision: tagging user outputs too would make them look "saved"
to the second compilation's partitioner. The split point comes from the output node's ``meta["desc"]`` (AOTAutograd writes ``SavedForBackwards*AOTOutput`` descriptors
for saved values in 2.13-2.15) or from an explicit ``num_fwd_outputs``.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Literal

import torch.fx

from ._accessors import _indices_problem, _is_int, custom_meta, mark_must_save
from ._compat import saved_output_descriptor_types
from ._errors import TagError
from ._keys import MUST_SAVE_INDICES
from .checks import require_graph_module, require_int

log = logging.getLogger(__name__)

SplitSource = Literal["argument", "descriptors", "unknown"]


@dataclass(frozen=True)
class SavedOutputsReport:
    """What ``tag_saved_outputs`` stamped.

    ``source`` says how saved values were told apart from user outputs: ``"argument"``
    (``num_fwd_outputs`` given), ``"descriptors"`` (output ``meta["desc"]``), or ``"unknown"``
    (neither available: every computed output was tagged).
    """

    source: SplitSource
    num_fwd_outputs: int | None
    tagged: tuple[str, ...]
    getitem_parents: dict[str, tuple[int, ...]]
    saved_placeholders: tuple[str, ...]


def check_num_fwd_outputs(value: object, where: str) -> int | None:
    """``num_fwd_outputs`` is None (decide from descriptors) or an int (range-checked by the
    caller against the output count)."""
    if value is None:
        return None
    return require_int(value, where=where, arg="num_fwd_outputs")


def _output_values(gm: torch.fx.GraphModule) -> tuple[torch.fx.Node, list[object]]:
    out = gm.graph.output_node() if hasattr(gm.graph, "output_node") else None
    if out is None:
        out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = out.args[0]
    if not isinstance(values, list | tuple):
        values = [values]
    return out, list(values)


def saved_positions_from_descriptors(output: torch.fx.Node, count: int) -> list[int] | None:
    """Positions of the saved-for-backward outputs per the output node's descriptors.

    None when the descriptors cannot decide: missing, of the wrong length, or all ``None``
    (hand-built joints); a list (possibly empty) otherwise.
    """
    descs = output.meta.get("desc")
    types = saved_output_descriptor_types()
    if not isinstance(descs, list | tuple) or len(descs) != count or not types:
        return None
    saved = [i for i, d in enumerate(descs) if isinstance(d, types)]
    if saved or all(d is not None for d in descs):
        return saved
    return None


def infer_num_fwd_outputs(fw_gm: torch.fx.GraphModule) -> int | None:
    """Number of leading user outputs of an AOT forward graph, from its descriptors."""
    out, values = _output_values(fw_gm)
    saved = saved_positions_from_descriptors(out, len(values))
    if saved is None:
        return None
    return saved[0] if saved else len(values)


def tag_saved_outputs(
    fw_gm: torch.fx.GraphModule, *, num_fwd_outputs: int | None = None
) -> SavedOutputsReport:
    """Stamp ``ap_must_save`` on the forward nodes the first partition saved for backward.

    A saved ``getitem(parent, i)`` stamps ``parent`` and records ``i`` (the getitem node itself
    carries nothing: no op is dispatched while interpreting it, so its meta would not survive a
    retrace). Saved placeholders are reported but not tagged (partitioners save inputs anyway).
    With ``num_fwd_outputs`` (or descriptors) only outputs past the user outputs are tagged.
    """
    require_graph_module(fw_gm, where="tag_saved_outputs", arg="fw_gm")
    check_num_fwd_outputs(num_fwd_outputs, "tag_saved_outputs")
    out, values = _output_values(fw_gm)
    if num_fwd_outputs is not None:
        if not 0 <= num_fwd_outputs <= len(values):
            raise ValueError(
                f"num_fwd_outputs={num_fwd_outputs} is outside [0, {len(values)}] for the "
                f"{len(values)} outputs of {out.name}"
            )
        source: SplitSource = "argument"
        positions = list(range(num_fwd_outputs, len(values)))
    else:
        from_desc = saved_positions_from_descriptors(out, len(values))
        if from_desc is not None:
            source = "descriptors"
            positions = from_desc
            num_fwd_outputs = from_desc[0] if from_desc else len(values)
        else:
            source = "unknown"
            positions = list(range(len(values)))
            log.info("tag_saved_outputs: no descriptors on %s; tagging every output", out.name)

    # Decide first, then write: a refusal (e.g. a malformed existing custom) leaves no tags.
    plain: list[torch.fx.Node] = []
    getitems: list[tuple[torch.fx.Node, int]] = []
    placeholders: list[str] = []
    for pos in positions:
        value = values[pos]
        if not isinstance(value, torch.fx.Node):
            continue
        if value.op == "placeholder":
            placeholders.append(value.name)
            continue
        if value.op != "call_function":
            continue
        if value.target is operator.getitem and isinstance(value.args[0], torch.fx.Node):
            index = value.args[1]
            if not _is_int(index) or index < 0:  # type: ignore[operator]
                raise TagError(
                    {value.name: [f"saved getitem has index {index!r}; need an int >= 0"]}
                )
            assert isinstance(index, int)
            getitems.append((value.args[0], index))
        else:
            plain.append(value)
    for node in [*plain, *(p for p, _ in getitems)]:
        # raises TagError on a non-dict custom / malformed index list before anything is written
        custom = custom_meta(node)
        existing = None if custom is None else custom.get(MUST_SAVE_INDICES)
        problem = None if existing is None else _indices_problem(existing)
        if problem is not None:
            raise TagError({node.name: [problem]})

    tagged: list[str] = []
    parents: dict[str, list[int]] = {}
    for node in plain:
        mark_must_save(node)
        if node.name not in tagged:
            tagged.append(node.name)
    for parent, index in getitems:
        mark_must_save(parent, index)
        if parent.name not in tagged:
            tagged.append(parent.name)
        idx = parents.setdefault(parent.name, [])
        if index not in idx:
            idx.append(index)
    return SavedOutputsReport(
        source=source,
        num_fwd_outputs=num_fwd_outputs,
        tagged=tuple(tagged),
        getitem_parents={k: tuple(v) for k, v in parents.items()},
        saved_placeholders=tuple(placeholders),
    )
