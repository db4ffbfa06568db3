"""The save rules: which forward values the replay keeps alive for the backward.

Rules, first match wins (``docs/architecture.md``, "Save rules"):

1. ``MUST_RECOMPUTE`` is never saved. It beats every rule below, sym and opaque included,
   because it is how the first compilation said "re-gather this FSDP weight in backward".
2. Sym nodes are saved (except SymBools that only feed ``_assert_scalar``): they are cheap and
   the backward's shapes may need them.
3. A multi-output op is never saved itself; its ``getitem`` children are: all of them when the
   parent is ``MUST_SAVE``, otherwise the ones the replay resolves as saved (rule 6).
4. Opaque values (process groups, script objects) are saved: they cannot be recomputed.
5. Placeholders are saved; extraction prunes the ones the backward does not read. The backward
   needs them to recompute FSDP chains from the sharded parameter.
6. ``MUST_SAVE`` is saved, and so is every value ``ap_tags.replayed_saves`` resolves as the
   first partition's: a *forward* node carrying a save tag (its own or its multi-output
   parent's) that a backward node reads. Tags inherited by backward nodes, by the interior of
   an op the retrace decomposed, or recorded as getitem indices of an op that no longer exists
   are not acted on (see ``ap_tags._replay``).
7. Anything else is recomputed in the backward if needed.

Rules 3 and 6 never save a *backward* node (``ap_tags.graph.backward_nodes``: marked by
AOTAutograd, or computed from one), whatever its tag: the first compilation ran it in the
backward, so the replay does too. torch's ``force_save_collectives`` (in the prologue) tags
every collective ``MUST_SAVE``, backward ones included, and a backward collective that reads
only forward values is no tangent's descendant: ``classify_nodes`` lists it as *unclaimed*, a
candidate. Saved, it would move into the forward and keep its output alive -- on FSDP + TP,
the TP all-gather of an activation that the first backward runs for a rowwise weight's
gradient (four extra saves of gathered activations on torchtitan's Llama3, issue #23).

After the rules, a saved lossless widening cast (a bf16 value's fp32 upcast) is saved as its
narrow source and recomputed in the backward where that costs nothing
(:mod:`ap_partitioner._narrow`: Inductor would otherwise store the upcast from the unrounded
fp32 sum and run the bf16 forward unrounded). Then a saved value that is a view of another
saved value is dropped and recomputed
in the backward from its saved base (:func:`without_views_of_saved`): two saved tensors sharing
one storage break AOTAutograd's donated-buffer rule. The saved storages stay the same.

PREFER_RECOMPUTE is deliberately ignored: a second-compile AC pass may only *add* saves (via
MUST_SAVE), never override what the first compilation saved.
"""

from __future__ import annotations

from collections.abc import Iterable, Set
from dataclasses import dataclass, field

import ap_tags
import torch.fx as fx
from ap_tags.checks import require_nodes
from ap_tags.graph import aliases_input, backward_nodes, is_getitem, is_multi_output
from torch.utils.checkpoint import CheckpointPolicy

from ap_partitioner import _compat


def policy(node: fx.Node) -> CheckpointPolicy | None:
    """torch's checkpoint policy on ``node`` (``meta["recompute"]``), if any."""
    value = ap_tags.recompute_policy(node)
    return value if isinstance(value, CheckpointPolicy) else None


def is_must_recompute(node: fx.Node) -> bool:
    """Only MUST_RECOMPUTE counts; PREFER_RECOMPUTE is a hint the replay ignores."""
    return policy(node) is CheckpointPolicy.MUST_RECOMPUTE


def is_policy_must_save(node: fx.Node) -> bool:
    return policy(node) is CheckpointPolicy.MUST_SAVE


def is_getitem_child(node: fx.Node) -> bool:
    """A getitem projecting one output of a multi-output node."""
    return is_getitem(node) and isinstance(node.args[0], fx.Node) and is_multi_output(node.args[0])


def _selected_children(parent: fx.Node, replayed: Set[fx.Node]) -> list[fx.Node]:
    """Rule 3: the getitem children of a multi-output ``parent`` the replay saves."""
    everything = is_policy_must_save(parent)
    return [
        user
        for user in parent.users
        if is_getitem(user)
        and not is_must_recompute(user)
        and not is_multi_output(user)
        and (everything or user in replayed)
    ]


@dataclass
class SavePlan:
    """The values to save, split the way ``_extract_fwd_bwd_modules`` takes them."""

    values: list[fx.Node] = field(default_factory=list)
    sym_nodes: list[fx.Node] = field(default_factory=list)
    opaque_nodes: list[fx.Node] = field(default_factory=list)

    def deduplicated(self) -> SavePlan:
        """First-seen order kept (as ``default_partition`` does); a value saved twice would be
        a duplicate forward output and a duplicate backward placeholder."""
        return SavePlan(
            list(dict.fromkeys(self.values)),
            list(dict.fromkeys(self.sym_nodes)),
            list(dict.fromkeys(self.opaque_nodes)),
        )

    def all_nodes(self) -> list[fx.Node]:
        return [*self.values, *self.sym_nodes, *self.opaque_nodes]


def apply_rule(
    node: fx.Node,
    plan: SavePlan,
    replayed: Set[fx.Node],
    backward: Set[fx.Node] = frozenset(),
) -> None:
    """Apply the first matching save rule for ``node`` to ``plan``; ``replayed`` holds the
    values ``ap_tags.replayed_saves`` resolved on the node's graph, ``backward`` its backward
    nodes (never saved as values, see the module doc)."""
    mod = _compat.partitioners()
    if is_must_recompute(node):
        return
    if mod.is_sym_node(node):
        if not _compat.is_assert_only_symbool(node):
            plan.sym_nodes.append(node)
        return
    if node in backward and not _compat.is_opaque_node(node):
        return
    if is_multi_output(node):
        plan.values.extend(_selected_children(node, replayed))
        return
    if _compat.is_opaque_node(node):
        plan.opaque_nodes.append(node)
        return
    if node.op == "placeholder":
        plan.values.append(node)
        return
    if is_getitem_child(node):
        if is_policy_must_save(node):
            plan.values.append(node)
        return
    if node in replayed or is_policy_must_save(node):
        plan.values.append(node)


def _views_a_saved_value(node: fx.Node, saved: Set[fx.Node]) -> bool:
    """``node`` is a view (through view ops only) of a value in ``saved`` other than itself."""
    current = node
    for _ in range(256):  # alias chains are short; the bound only guards malformed graphs
        source = current.args[0] if current.args else None
        if current.op != "call_function" or not aliases_input(current):
            return False
        if not isinstance(source, fx.Node):
            return False
        if source in saved:
            return True
        current = source
    return False


def without_views_of_saved(plan: SavePlan) -> tuple[SavePlan, tuple[str, ...]]:
    """``plan`` without the saved values that are views of another saved value, and their
    names.

    Why: AOTAutograd donates a saved tensor to the backward (lets Inductor reuse its buffer in
    place) when it aliases no forward input or output -- it does not check the *other* saved
    tensors. The first partition's replay can save both ``relu`` and ``view_39 =
    reshape(relu)``; both are donated, the backward writes ``threshold_backward`` into
    ``relu``'s buffer and then reads ``view_39`` for a weight gradient: a wrong gradient
    (``nn.TransformerEncoder``'s ``linear2.weight`` on 2 ranks, where bucketing's order put the
    write first). A view of a saved value costs nothing to recompute in the backward, and then
    Inductor sees the read and keeps the buffer; the saved storages are the same.
    """
    saved = set(plan.values)
    dropped = [v for v in plan.values if _views_a_saved_value(v, saved)]
    if not dropped:
        return plan, ()
    gone = set(dropped)
    kept = SavePlan(
        [v for v in plan.values if v not in gone], list(plan.sym_nodes), list(plan.opaque_nodes)
    )
    return kept, tuple(v.name for v in dropped)


def plan_saves(
    candidates: Iterable[fx.Node], *, replayed: Iterable[fx.Node] | None = None
) -> SavePlan:
    """Apply the rules to every candidate (forward-required, then unclaimed nodes), deduped.

    ``replayed``: the values resolved as the first partition's saves; by default
    ``ap_tags.replayed_saves`` of the candidates' graph. The candidates' backward nodes
    (``ap_tags.graph.backward_nodes``) are never saved as values.
    """
    nodes = require_nodes(candidates, where="plan_saves", arg="candidates")
    backward = backward_nodes(nodes[0].graph) if nodes else set()
    if replayed is None:
        resolved: Set[fx.Node] = (
            set(ap_tags.replayed_saves(nodes[0].graph).values) if nodes else set()
        )
    else:
        resolved = set(require_nodes(replayed, where="plan_saves", arg="replayed"))
    plan = SavePlan()
    for node in nodes:
        if node.op == "output":
            continue
        apply_rule(node, plan, resolved, backward)
    return plan.deduplicated()
