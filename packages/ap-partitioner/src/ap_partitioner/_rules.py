"""The save rules: which forward values the replay keeps alive for the backward.

Rules, first match wins (``docs/architecture.md``, "Save rules"):

1. ``MUST_RECOMPUTE`` is never saved. It beats every rule below, sym and opaque included,
   because it is how the first compilation said "re-gather this FSDP weight in backward".
2. Sym nodes are saved (except SymBools that only feed ``_assert_scalar``): they are cheap and
   the backward's shapes may need them.
3. A multi-output op is never saved itself; its ``getitem`` children are: all of them when the
   parent is ``MUST_SAVE``, otherwise the ones listed in ``ap_must_save_getitem_indices``. A
   getitem child's own ``ap_must_save`` is ignored: ap-tags never writes it there, so it can
   only be the parent's tag inherited through retracing, and honouring it would defeat the
   index list.
4. Opaque values (process groups, script objects) are saved: they cannot be recomputed.
5. Placeholders are saved; extraction prunes the ones the backward does not read. The backward
   needs them to recompute FSDP chains from the sharded parameter.
6. ``ap_must_save`` or ``MUST_SAVE`` is saved.
7. Anything else is recomputed in the backward if needed.

PREFER_RECOMPUTE is deliberately ignored: a second-compile AC pass may only *add* saves (via
MUST_SAVE), never override what the first compilation saved.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import ap_tags
import torch.fx as fx
from ap_tags.checks import require_nodes
from ap_tags.graph import is_getitem, is_multi_output
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


def has_replay_tag(node: fx.Node) -> bool:
    """``custom["ap_must_save"]``: the first compilation saved this node's value."""
    return ap_tags.is_must_save(node)


def replay_indices(node: fx.Node) -> frozenset[int] | None:
    """The getitem indices the first compilation saved of a multi-output ``node``; None (all
    of them) when the parent carries no list."""
    indices = ap_tags.must_save_indices(node)
    return frozenset(indices) if indices else None


def is_getitem_child(node: fx.Node) -> bool:
    """A getitem projecting one output of a multi-output node."""
    return is_getitem(node) and isinstance(node.args[0], fx.Node) and is_multi_output(node.args[0])


def _selected_children(parent: fx.Node) -> list[fx.Node]:
    """Rule 3: the getitem children of a multi-output ``parent`` the replay saves."""
    if is_policy_must_save(parent):
        indices: frozenset[int] | None = None
    elif has_replay_tag(parent):
        indices = replay_indices(parent)
    else:
        return []
    return [
        user
        for user in parent.users
        if is_getitem(user)
        and not is_must_recompute(user)
        and not is_multi_output(user)
        and (indices is None or user.args[1] in indices)
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


def apply_rule(node: fx.Node, plan: SavePlan) -> None:
    """Apply the first matching save rule for ``node`` to ``plan``."""
    mod = _compat.partitioners()
    if is_must_recompute(node):
        return
    if mod.is_sym_node(node):
        if not mod._is_assert_only_symbool(node):
            plan.sym_nodes.append(node)
        return
    if is_multi_output(node):
        plan.values.extend(_selected_children(node))
        return
    if mod.is_opaque_node(node):
        plan.opaque_nodes.append(node)
        return
    if node.op == "placeholder":
        plan.values.append(node)
        return
    if is_getitem_child(node):
        if is_policy_must_save(node):
            plan.values.append(node)
        return
    if has_replay_tag(node) or is_policy_must_save(node):
        plan.values.append(node)


def plan_saves(candidates: Iterable[fx.Node]) -> SavePlan:
    """Apply the rules to every candidate (forward-required, then unclaimed nodes), deduped."""
    plan = SavePlan()
    for node in require_nodes(candidates, where="plan_saves", arg="candidates"):
        if node.op == "output":
            continue
        apply_rule(node, plan)
    return plan.deduplicated()
