"""Scoped patches of torch's partitioner and AOTAutograd that make 2.11-2.13 decide as 2.14+/2.15
do (random ops in the first partition, backward ``custom`` metadata).

Part of the compat seam (:mod:`ap_backend._compat`): every private torch name is looked up
at call time through ``SUPPORT``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from ap_tags.graph import is_rng_op
from ap_tags.scoped import ScopedPatch

from ._support import SUPPORT, UnsupportedTorchError

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- random ops


def _rng_rule_like_2_14() -> Callable[[], None]:
    mod: Any = SUPPORT.attrs(
        "torch._functorch.partitioners", ("has_recomputable_rng_ops", "must_recompute")
    )
    if hasattr(mod, "is_rng_op"):  # 2.14+: torch already decides this way
        return lambda: None
    old = mod.has_recomputable_rng_ops
    must_recompute = mod.must_recompute

    def has_recomputable_rng_ops(fx_g: torch.fx.GraphModule) -> bool:
        return any(must_recompute(n) and is_rng_op(n) for n in fx_g.graph.nodes)

    mod.has_recomputable_rng_ops = has_recomputable_rng_ops

    def undo() -> None:
        mod.has_recomputable_rng_ops = old

    return undo


#: While held, ``default_partition`` on a torch without ``partitioners.is_rng_op`` (2.11-2.13)
#: decides "does the graph recompute a random op?" as 2.14+ does. Why: there, an AC-recomputed
#: zero-dropout SDPA counts as random, so ``functionalize_rng_ops`` wraps it in
#: ``run_and_save_rng_state``, and the second compile, retracing the first compilation's
#: forward under ``FunctionalTensorMode``, fails: no torch registers a functionalization rule
#: for that HOP. With the 2.14 rule (``ap_tags.graph.is_rng_op``, which carries it) the SDPA is
#: recomputed as the deterministic op it is. A graph that recomputes a real random op keeps
#: torch's behaviour. On 2.14+ a no-op.
FIRST_PARTITION_RNG_RULE = ScopedPatch(
    "partitioners.has_recomputable_rng_ops = the 2.14 is_rng_op rule", _rng_rule_like_2_14
)


# --------------------------------------------------------------------------- backward metadata

_GRAPH_CAPTURE = "torch._functorch._aot_autograd.graph_capture"
_METADATA_COPY = "copy_fwd_metadata_to_bw_nodes"


def metadata_copy_replaces_custom(copy: Callable[[torch.fx.GraphModule], None]) -> bool:
    """Whether AOTAutograd's forward-to-backward metadata copy ``copy`` *replaces* a backward
    node's ``custom`` dict with its forward node's (torch 2.11) instead of merging the forward's
    keys over it (2.15). Decided by running it on a two-node graph, not by version: a forward
    node and a backward node (``partitioner_tag == "is_backward"``) sharing one ``seq_nr``, each
    with a ``custom`` key of its own; the backward one keeps its key only where ``copy`` merges."""
    graph = torch.fx.Graph()
    forward = graph.placeholder("x")
    forward.meta.update(seq_nr=0, custom={"forward_key": 1})
    backward = graph.call_function(torch.neg, (forward,))
    backward.meta.update(seq_nr=0, partitioner_tag="is_backward", custom={"backward_key": 1})
    graph.output(backward)
    copy(torch.fx.GraphModule(torch.nn.Module(), graph))
    custom = backward.meta.get("custom")
    return not (isinstance(custom, dict) and "backward_key" in custom)


def _merge_backward_custom_like_2_15() -> Callable[[], None]:
    try:
        mod: Any = SUPPORT.attrs(_GRAPH_CAPTURE, (_METADATA_COPY,))
    except UnsupportedTorchError:  # a torch without this copy has nothing to merge
        return lambda: None
    old = getattr(mod, _METADATA_COPY)
    try:
        replaces = metadata_copy_replaces_custom(old)
    except Exception:  # a copy that refuses the probe graph: leave torch's as it is
        log.debug("%s: probe failed; torch's copy left as it is", _METADATA_COPY, exc_info=True)
        replaces = False
    if not replaces:  # 2.15: torch already merges
        return lambda: None

    def copy_merging(fx_g: torch.fx.GraphModule) -> None:
        own = {
            node: node.meta["custom"]
            for sub in fx_g.modules()
            if isinstance(sub, torch.fx.GraphModule)
            for node in sub.graph.nodes
            if isinstance(node.meta.get("custom"), dict)
        }
        old(fx_g)
        for node, custom in own.items():
            copied = node.meta.get("custom")
            if isinstance(copied, dict) and copied is not custom:
                node.meta["custom"] = {**custom, **copied}

    setattr(mod, _METADATA_COPY, copy_merging)

    def undo() -> None:
        setattr(mod, _METADATA_COPY, old)

    return undo


#: While held, AOTAutograd's forward-to-backward metadata copy keeps a backward node's own
#: ``custom`` keys under the forward node's (torch 2.15's merge) on a torch whose copy replaces
#: the whole dict (2.11). Why: in the second compilation the retraced first compilation is one
#: autograd op, so every backward node gets the ``custom`` of its first forward op; a replacing
#: copy drops the FQN the first compilation stamped on each backward node
#: (``ap_epchunk.tag_backward_module_fqns``), and ap-bucketing then saw the whole backward as the
#: block ``tok_embeddings``: one bucket of every re-gather and one of every gradient
#: (torch 2.11, H200: 6.07 GiB peak against 5.19 unbucketed). Where torch merges, a no-op.
BACKWARD_CUSTOM_MERGE = ScopedPatch(
    "graph_capture.copy_fwd_metadata_to_bw_nodes merges custom (2.15)",
    _merge_backward_custom_like_2_15,
)
