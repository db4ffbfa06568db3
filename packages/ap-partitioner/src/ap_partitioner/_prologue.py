"""torch's standard partitioner prologue, as ``min_cut_rematerialization_partition`` runs it,
minus CSE.

The replay sees the graph min-cut would, normalized the same way: DCE, ``cleanup_recompute_tags``,
``force_save_collectives`` (2.13/2.14 tag the collective, 2.15 its leaf outputs: both are
honoured by the MUST_SAVE rules), ``force_save_effectful_ops`` and ``force_save_bw_mutation_src``.
Their MUST_SAVE tags matter: collectives must not be silently re-run, effects must not repeat,
and a value the backward mutates must not be recomputed from its mutated state.

Why no CSE: the retraced backward is the first compilation's backward, recomputations
included, and what it reads from the forward is exactly what the first partition saved
(``ap_tags.replayed_saves``). CSE would merge those backward recomputations into identical
forward values (a layer norm's normalized input, a bf16 ``silu``'s fp32 upcast), moving what the
backward reads onto values the first partition never saved -- and then either saving more or
recomputing a matmul in the backward. min-cut wants that freedom; a replay must not have it.
Inductor still CSEs each of the forward and backward graphs when it lowers them.

One deliberate deviation: an effectful (``with_effects``) forward op tagged for recomputation
cannot be recomputed (its token chain is fixed before partitioning). 2.15 raises on an explicit
MUST_RECOMPUTE there, 2.13/2.14 silently skip saving it and emit an invalid backward. Tags can
reach such a node by retrace inheritance, which is not the user's intent, so the prologue
re-tags it MUST_SAVE first, names it in the report and logs a warning, on every version alike.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ap_partitioner import _compat
from ap_partitioner._working_copy import working_copy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prologue:
    """What the prologue found, needed again by the epilogue."""

    module: fx.GraphModule
    has_recomputable_ops: bool
    has_recomputable_rng_ops: bool
    effectful_retagged: tuple[str, ...]


def effectful_recompute_nodes(graph: fx.Graph) -> list[fx.Node]:
    """Forward ``with_effects`` nodes carrying a MUST/PREFER_RECOMPUTE policy."""
    mod = _compat.partitioners()
    return [
        n
        for n in graph.nodes
        if _compat.is_with_effects(n) and not mod._has_tag_is_backward(n) and mod.must_recompute(n)
    ]


def save_effectful_instead_of_recompute(graph: fx.Graph) -> tuple[str, ...]:
    """Re-tag recompute-tagged effectful forward ops MUST_SAVE (see module doc)."""
    nodes = effectful_recompute_nodes(graph)
    for node in nodes:
        node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    names = tuple(n.name for n in nodes)
    if names:
        log.warning(
            "ap-partitioner: effectful ops cannot be recomputed; saving instead of the "
            "recompute policy they carry: %s",
            ", ".join(names),
        )
    return names


def dce_would_remove_nothing(graph: fx.Graph) -> bool:
    """True when ``eliminate_dead_code`` provably has nothing to do, decided without mutating.

    DCE only erases nodes without users (placeholders and the output never), cascading from
    those; with no user-less node there is nothing to start from. It also recurses into
    ``get_attr`` subgraph modules, so any ``get_attr`` makes the answer "maybe" (False).
    """
    for node in graph.nodes:
        if node.op == "get_attr":
            return False
        if not node.users and node.op not in ("placeholder", "output"):
            return False
    return True


def normalized_copy(joint_module: fx.GraphModule) -> fx.GraphModule:
    """A working copy of ``joint_module`` with dead code eliminated (no CSE: see the module
    doc); ``joint_module`` is left exactly as it was. DCE runs only when it has work."""
    copy = working_copy(joint_module)
    if not dce_would_remove_nothing(copy.graph):
        copy.graph.eliminate_dead_code()
        copy.recompile()
    return copy


def run_prologue(joint_module: fx.GraphModule) -> Prologue:
    """Normalize a copy of ``joint_module`` (the caller's graph is not touched)."""
    mod = _compat.partitioners()
    joint_module = normalized_copy(joint_module)
    has_recompute = bool(mod.has_recomputable_ops(joint_module))
    has_rng = bool(mod.has_recomputable_rng_ops(joint_module))
    if has_recompute:
        joint_module = mod.cleanup_recompute_tags(joint_module, is_default_partition=False)
    if not _compat.functorch_config().unsafe_allow_optimization_of_collectives:
        mod.force_save_collectives(joint_module)
    retagged = save_effectful_instead_of_recompute(joint_module.graph)
    mod.force_save_effectful_ops(joint_module)
    mod.force_save_bw_mutation_src(joint_module)
    return Prologue(joint_module, has_recompute, has_rng, retagged)
