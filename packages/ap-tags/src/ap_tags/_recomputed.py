"""``release_recomputed_saves``: a backward graph's recomputed forward ops carry no save tags.

When the first partition recomputes a forward op in the backward (AC staged it
``PREFER_RECOMPUTE``, or it is a multi-output op whose tuple torch's ``default_partition`` never
saves even when tagged ``MUST_SAVE``), extraction copies the joint node's meta onto the backward
copy: the copy keeps ``recompute=MUST_SAVE`` from the joint, and shares the joint node's
``custom`` dict (``node_copy`` copies meta shallowly), so the ``ap_must_save`` that
``tag_saved_outputs`` later writes on the *forward* node shows up on the backward copy too.
Interpreting the backward graph under ``preserve_node_meta`` carries both into the second
compilation, where the save-all partitioner then saves the copy's outputs -- the forward runs
the op twice and keeps a value the first partition never kept (SDPA's output, with AC on).

The first partition's decision for such a node was "recompute", so its save directives are
stale: drop them, on the copy only. The forward node keeps its tags (the copy gets its own
``custom`` dict; nothing shared is mutated).
"""

from __future__ import annotations

import logging
from typing import Any

import torch.fx

from ._compat import checkpoint_policy, tracer_copies_autograd_backward
from ._keys import CUSTOM, MUST_SAVE, MUST_SAVE_INDICES, RECOMPUTE
from .checks import require_graph_module
from .graph import FORWARD_PARTITIONER_TAGS, is_backward_node

log = logging.getLogger(__name__)


#: The node-meta key torch's backward extraction and tracer use for backward nodes.
_BACKWARD = "autograd_backward"
#: AOTAutograd's backward ``partitioner_tag`` (``ap_tags.graph.BACKWARD_PARTITIONER_TAGS``).
_RETAGGED = "is_backward"


def is_backward_graph(gm: torch.fx.GraphModule) -> bool:
    """A graph ``_extract_fwd_bwd_modules`` extracted as the backward: it marks every backward
    ``call_function`` ``autograd_backward`` (2.13-2.15); on 2.11/2.12 the backward ops carry
    AOTAutograd's backward ``partitioner_tag`` only."""
    return any(is_backward_node(n) for n in gm.graph.nodes if n.op == "call_function")


def is_recomputed_forward_op(node: torch.fx.Node) -> bool:
    """A forward op in a backward graph: the partition recomputed it there."""
    # AOTAutograd's forward ``partitioner_tag`` in a backward graph: recomputed there
    return (
        node.op == "call_function" and node.meta.get("partitioner_tag") in FORWARD_PARTITIONER_TAGS
    )


def _stale(node: torch.fx.Node) -> tuple[bool, bool]:
    policy = checkpoint_policy()
    custom = node.meta.get(CUSTOM)
    has_replay = isinstance(custom, dict) and (MUST_SAVE in custom or MUST_SAVE_INDICES in custom)
    saves = node.meta.get(RECOMPUTE) in (policy.MUST_SAVE, policy.PREFER_SAVE)
    return has_replay, saves


def mark_backward_graph(bw_gm: torch.fx.GraphModule) -> int:
    """Mark every ``call_function`` / ``get_attr`` of a backward graph ``autograd_backward``,
    as torch 2.13+'s ``_extract_fwd_bwd_modules`` does; return how many nodes were newly marked.

    Why: a second compilation tells its joint's backward nodes apart by that mark, which the
    tracer copies from the interpreted node (``fx.proxy``, 2.12+). On torch 2.12 extraction does
    not set it, so the forward ops the first partition recomputed in its backward (they keep
    ``partitioner_tag="is_forward"``) were retraced as *forward* nodes: the save-all replay then
    saved their outputs, and the forward ran SDPA twice (ap-partitioner's SDPA replay test,
    10 saves where the first partition kept 8). torch 2.11's tracer copies ``partitioner_tag``
    but not this mark, so there the recomputed forward ops' ``partitioner_tag`` becomes
    ``is_backward`` too (the demo with AC on 2.11: SaveAll saved 30 where the first partition
    kept 27). Idempotent, so it runs on every torch. A graph that is not a backward graph is
    left alone.
    """
    require_graph_module(bw_gm, where="mark_backward_graph", arg="bw_gm")
    if not is_backward_graph(bw_gm):
        return 0
    # torch 2.11's tracer does not copy the mark; it copies ``partitioner_tag``, so there the
    # recomputed forward ops are retagged backward (the decision is made: they run there)
    retag = not tracer_copies_autograd_backward()
    marked = 0
    for node in bw_gm.graph.nodes:
        if retag and is_recomputed_forward_op(node):
            node.meta["partitioner_tag"] = _RETAGGED
        if node.op in ("call_function", "get_attr") and node.meta.get(_BACKWARD) is not True:
            node.meta[_BACKWARD] = True
            marked += 1
    return marked


def unmark_forward_graph(fw_gm: torch.fx.GraphModule) -> tuple[str, ...]:
    """Clear ``autograd_backward`` from every node of a forward graph; return the names cleared.

    Why: min-cut moves backward-origin nodes that read only forward values into the forward
    when saving their output is cheaper (relu's backward mask ``le(relu, 0)``, one byte an
    element where ``relu`` is four; a weight's transposed view). Extraction copies the joint
    node's meta, so in the forward graph those nodes still say ``autograd_backward``; the tracer
    copies that mark (2.12+) onto the node the second compilation traces while the forward runs
    them, and the replay then took the saved mask for a backward node and recomputed it (the
    first partition saved 6 values, the replay 5). In a forward graph every node runs in the
    forward: the mark is false there by construction.
    """
    require_graph_module(fw_gm, where="unmark_forward_graph", arg="fw_gm")
    cleared = []
    for node in fw_gm.graph.nodes:
        if node.meta.pop(_BACKWARD, None) is not None:
            cleared.append(node.name)
    if cleared:
        log.debug("unmark_forward_graph: %s", cleared)
    return tuple(cleared)


def release_recomputed_saves(bw_gm: torch.fx.GraphModule) -> tuple[str, ...]:
    """Drop ``ap_must_save``/its indices and a ``MUST_SAVE``/``PREFER_SAVE`` policy from the
    recomputed forward ops of a backward graph; return the names of the nodes changed.

    A graph that is not a backward graph is left alone (a forward graph's save tags are the
    point). ``MUST_RECOMPUTE``/``PREFER_RECOMPUTE`` stay: they already say "recompute".
    """
    require_graph_module(bw_gm, where="release_recomputed_saves", arg="bw_gm")
    if not is_backward_graph(bw_gm):
        return ()
    changed: list[str] = []
    for node in bw_gm.graph.nodes:
        if not is_recomputed_forward_op(node):
            continue
        has_replay, saves = _stale(node)
        if not (has_replay or saves):
            continue
        if has_replay:
            custom: dict[str, Any] = dict(node.meta[CUSTOM])  # own copy: the dict is shared
            custom.pop(MUST_SAVE, None)
            custom.pop(MUST_SAVE_INDICES, None)
            node.meta[CUSTOM] = custom
        if saves:
            del node.meta[RECOMPUTE]
        changed.append(node.name)
    if changed:
        log.debug("release_recomputed_saves: %s", changed)
    return tuple(changed)
