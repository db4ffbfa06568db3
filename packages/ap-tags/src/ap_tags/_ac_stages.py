"""Staged activation checkpointing for a joint graph: recompute by default, save at stage cuts.

Every forward value the backward needs is tagged ``PREFER_RECOMPUTE``; the forward is then cut
at a few points and the values live at each cut are tagged ``MUST_SAVE``. The backward thus
recomputes one segment at a time from saved values, trading a little saved memory for about one
extra forward. Where the cuts go (``_ac_cuts``): with a ``stage_size_gib``, one per stage of
about that many bytes, at the stage's least-alive point; with ``"auto"``, the cuts that
minimise the backward's peak (saved bytes plus the largest segment recomputed).

Tags written here carry ``ac_graph_id=FSDP_AC_GRAPH_ID``. Anything that already had a
``recompute`` tag from another id is a user annotation (torch SAC) and is never overwritten.
Collectives (``_c10d_functional``) are not tagged: a recompute tag would let the partitioner
re-issue communication in the backward (torch's ``must_recompute`` treats PREFER like MUST, and
``force_save_collectives`` skips nodes that carry it). FSDP chains are ``MUST_RECOMPUTE`` already
(``mark_fsdp_all_gather_recomputation``) and are neither counted nor saved.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx

from . import checks
from ._ac_cuts import auto_cut_points, least_alive_points, stage_cuts
from ._accessors import ac_graph_id, recompute_policy, set_recompute
from ._compat import checkpoint_policy
from ._keys import FSDP_AC_GRAPH_ID
from .checks import require_graph
from .graph import (
    aliases_input,
    backward_nodes,
    is_collective,
    is_wait,
    node_nbytes,
    op_overload,
    storage_base,
)

log = logging.getLogger(__name__)

_GIB = 1 << 30

StageSize = float | Literal["auto"]


@dataclass(frozen=True)
class AcStageReport:
    """What ``mark_ac_stages`` decided (node names in graph order)."""

    stage_size_bytes: int
    total_bytes: int
    stages: int
    prefer_recompute: tuple[str, ...]
    must_save: tuple[str, ...]
    user_annotated: tuple[str, ...]


def check_stage_size(
    value: object, *, where: str = "mark_ac_stages", arg: str = "stage_size_gib"
) -> StageSize:
    """``"auto"`` or a positive finite number of GiB (returned as float).

    A value of another type (a bool, None) is a ``TypeError``; another string, or a number that
    is not positive and finite, is a ``ValueError``.
    """
    expected = "'auto' or a positive finite number of GiB"
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(f"{where}: {arg} must be {expected}, got {value!r}")
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{where}: {arg} must be {expected}, got {checks.describe(value)}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: {arg} must be {expected}, got {value!r}")
    return float(value)


def _ancestors(nodes: Iterable[torch.fx.Node]) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = [i for n in nodes for i in n.all_input_nodes]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def recomputable_forward_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """Forward ``call_function`` nodes whose value the backward needs, directly or transitively."""
    bw = backward_nodes(graph)
    needed = _ancestors(bw)
    return [n for n in graph.nodes if n.op == "call_function" and n not in bw and n in needed]


def _is_functional_collective(node: torch.fx.Node) -> bool:
    """Collectives and their waits: neither is ever tagged for recomputation here."""
    return is_collective(node) or is_wait(node)


def mark_ac_stages(
    graph: torch.fx.Graph | torch.fx.GraphModule, *, stage_size_gib: StageSize = "auto"
) -> AcStageReport:
    """Tag a joint graph for staged recomputation (see the module docstring). Returns a report.

    Refuses (ValueError / TagError) before writing anything when ``stage_size_gib`` is invalid
    or an existing ``recompute``/``ac_graph_id`` tag is malformed.
    """
    g = require_graph(graph, where="mark_ac_stages")
    size_opt = check_stage_size(stage_size_gib)
    policy = checkpoint_policy()
    order = {n: i for i, n in enumerate(g.nodes)}
    candidates = recomputable_forward_nodes(g)
    existing = {n: (recompute_policy(n), ac_graph_id(n)) for n in candidates}  # validates

    def is_user(n: torch.fx.Node) -> bool:
        pol, gid = existing[n]
        return pol is not None and gid != FSDP_AC_GRAPH_ID

    to_prefer = [
        n
        for n in candidates
        if existing[n][0] is None
        and n.target is not operator.getitem
        and not _is_functional_collective(n)
    ]
    # Values the pass may save: everything but forced recomputes, user regions and collectives
    # (torch pins the latter itself), and multi-output ops: their tuple is no tensor to save
    # (torch's min-cut refuses a MUST_SAVE tuple whose getitems it must recompute, e.g. the
    # ``sort`` of an expert-parallel MoE's stable argsort); their getitems are saved instead.
    savable = [
        n
        for n in candidates
        if existing[n][0] is not policy.MUST_RECOMPUTE
        and not is_user(n)
        and not _is_functional_collective(n)
        and not isinstance(n.meta.get("val"), list | tuple)
    ]
    sizes = [node_nbytes(n) for n in savable]
    total = sum(sizes)
    bw = backward_nodes(g)
    spans = _forward_spans(savable, order, bw)
    alive = _alive_bytes(spans, sizes)
    if not total:
        stage_bytes, points = 0, list[int]()
    elif size_opt == "auto":
        stage_bytes, points = auto_cut_points([recompute_bytes(n) for n in savable], alive)
    else:
        stage_bytes = max(1, int(size_opt * _GIB))
        points = least_alive_points(alive, stage_cuts(sizes, stage_bytes))
    to_save = _alive_at(savable, spans, points)
    if size_opt == "auto":
        # A view shares its base's storage; "auto" tags the base, which partitioners save as a
        # tensor of its own (a MUST_SAVE view of a recomputed base was dropped: LLaMA-3 8B's one
        # cut, the final norm's output view, saved 0 bytes and the backward recomputed the whole
        # forward). A fixed stage size keeps tagging what is alive, as it always did.
        savable_set = set(savable)
        to_save = {b if (b := storage_base(n)) in savable_set else n for n in to_save}

    for n in to_prefer:
        set_recompute(n, policy.PREFER_RECOMPUTE, FSDP_AC_GRAPH_ID)
    for n in to_save:
        set_recompute(n, policy.MUST_SAVE, FSDP_AC_GRAPH_ID)
    report = AcStageReport(
        stage_size_bytes=stage_bytes,
        total_bytes=total,
        stages=len(points),
        prefer_recompute=tuple(n.name for n in to_prefer if n not in to_save),
        must_save=tuple(n.name for n in sorted(to_save, key=order.__getitem__)),
        user_annotated=tuple(n.name for n in candidates if is_user(n)),
    )
    log.info(
        "AC stages: %d stages of %.3f GiB over %.3f GiB; %d recompute, %d saved",
        report.stages,
        stage_bytes / _GIB,
        total / _GIB,
        len(report.prefer_recompute),
        len(report.must_save),
    )
    return report


def recompute_bytes(node: torch.fx.Node) -> int:
    """What recomputing ``node`` in the backward materialises, as ``"auto"`` weighs a segment.

    Views materialise nothing, and pointwise ops fuse into the backward kernels that read them
    (Inductor recomputes them there, as min-cut plans it); everything else -- matmuls,
    attention, reductions, embeddings -- writes its output. Counting every value's bytes would
    weigh a cross-entropy head's chain of ``[tokens, vocab]`` pointwise values (four fp32 ones,
    16.8 GB at LLaMA-3 8B's shapes) as if each were stored, so that segment would dwarf every
    layer and no cut would pay.
    """
    op = op_overload(node)
    if aliases_input(node) or (op is not None and torch.Tag.pointwise in op.tags):
        return 0
    return node_nbytes(node)


def _forward_spans(
    savable: list[torch.fx.Node], order: dict[torch.fx.Node, int], backward: set[torch.fx.Node]
) -> list[tuple[int, int]]:
    """``(definition, last forward use)`` positions of each savable value, walked once.

    A value is alive at forward position p when ``definition <= p < last forward use``: that set
    is exactly what resuming the forward from p needs, so saving it lets the backward recompute
    everything after p from saved values alone. (Backward uses do not keep a value alive here;
    recomputation serves them.)
    """
    spans = []
    for n in savable:
        uses = [order[u] for u in n.users if u.op != "output" and u not in backward]
        spans.append((order[n], max(uses, default=order[n])))
    return spans


def _alive_bytes(spans: list[tuple[int, int]], sizes: list[int]) -> list[int]:
    """Bytes of savable values alive at each savable value's position (``spans``' order)."""
    events: dict[int, int] = {}
    for (start, last), size in zip(spans, sizes, strict=True):
        if last > start and size:
            events[start] = events.get(start, 0) + size
            events[last] = events.get(last, 0) - size
    positions = [start for start, _ in spans]
    alive_at: dict[int, int] = {}
    running = 0
    wanted = set(positions)
    for pos in sorted(set(events) | wanted):
        running += events.get(pos, 0)
        if pos in wanted:
            alive_at[pos] = running
    return [alive_at[p] for p in positions]


def _alive_at(
    savable: list[torch.fx.Node], spans: list[tuple[int, int]], points: list[int]
) -> set[torch.fx.Node]:
    """The savable values alive at each cut (indices into ``savable``)."""
    chosen: set[torch.fx.Node] = set()
    for point in points:
        at = spans[point][0]
        chosen.update(
            n for n, (first, last) in zip(savable, spans, strict=True) if first <= at < last
        )
    return chosen


class AcJointPass:
    """``torch._functorch.config.joint_custom_pass`` callable running ``mark_ac_stages``.

    Keeps the reports of every joint graph it saw in ``reports`` (one per compiled graph).
    """

    def __init__(self, stage_size_gib: StageSize = "auto") -> None:
        self.stage_size_gib = check_stage_size(stage_size_gib, where="ac_joint_pass")
        self.reports: list[AcStageReport] = []

    def __call__(self, fx_g: torch.fx.GraphModule, joint_inputs: Any) -> torch.fx.GraphModule:
        self.reports.append(mark_ac_stages(fx_g, stage_size_gib=self.stage_size_gib))
        return fx_g

    def uuid(self) -> str:
        """What this pass does, for a cache key (Inductor's ``CustomGraphPass`` protocol):
        ``mark_ac_stages`` at this stage size -- its code is ap-tags' own, which a key
        covering ap-tags' sources names."""
        return f"ap_tags.ac_joint_pass(stage_size_gib={self.stage_size_gib!r})"


def ac_joint_pass(
    stage_size_gib: StageSize = "auto",
) -> Callable[[torch.fx.GraphModule, Any], torch.fx.GraphModule]:
    """A joint pass for ``torch._functorch.config.patch(joint_custom_pass=...)``."""
    return AcJointPass(stage_size_gib)
