"""``preserve_meta_compiler``: the first compilation's fw/bw "compiler" that carries tags forward.

It does not compile. It returns a boxed callable that runs the graph through
``torch.fx.Interpreter`` under ``torch.fx.traceback.preserve_node_meta()``. When a later
``torch.compile`` traces that callable, every node the tracer creates while an interpreted node
runs copies that node's ``custom``, ``recompute``, ``ac_graph_id`` and ``partitioner_tag``
(``torch.fx.proxy._COPY_META_FIELDS``): that is how the first partition's decisions reach the
second.

How the forward compiler knows which outputs are user outputs: AOTAutograd's forward graph
output node carries ``meta["desc"]``, a list of output descriptors in which saved values are
``SavedForBackwardsAOTOutput`` / ``SavedForBackwardsNoVcCheckAOTOutput`` (torch 2.13-2.15,
``_extract_fwd_bwd_modules``). The compiler reads that; ``num_fwd_outputs=`` overrides it for
graphs without descriptors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx
import torch.fx.traceback as fx_traceback

from ._compat import replay_scope, require_fx_traceback
from ._first_forward import register_first_forward
from ._recomputed import mark_backward_graph, release_recomputed_saves, unmark_forward_graph
from ._saved import SavedOutputsReport, check_num_fwd_outputs, tag_saved_outputs
from .checks import require_bool, require_graph_module

log = logging.getLogger(__name__)


class InterpretedGraph:
    """A boxed callable (AOTAutograd's ``_boxed_call`` convention: one list argument, which is
    cleared) that interprets ``gm`` with node meta preserved. ``saved_report`` holds what the
    forward tagging stamped, when it ran."""

    _boxed_call = True

    def __init__(self, gm: torch.fx.GraphModule, saved_report: SavedOutputsReport | None) -> None:
        self.gm = gm
        self.saved_report = saved_report

    def __call__(self, args: list[Any]) -> Any:
        with fx_traceback.preserve_node_meta(), replay_scope(args):
            return torch.fx.Interpreter(self.gm).boxed_run(args)


def preserve_meta_compiler(
    tag_forward: bool = False, num_fwd_outputs: int | None = None
) -> Callable[[torch.fx.GraphModule, Sequence[Any]], InterpretedGraph]:
    """Return an AOTAutograd fw/bw compiler ``(gm, example_inputs) -> boxed callable``.

    ``tag_forward=True`` (use it for ``fw_compiler`` only) first stamps ``ap_must_save`` on the
    values the partition saved (``tag_saved_outputs``); user outputs are told apart by the
    output descriptors or by ``num_fwd_outputs``. Otherwise, on a backward graph, the forward
    ops the partition recomputed there lose the save tags they inherited from the joint
    (``release_recomputed_saves``), so the second compilation does not save what the first
    recomputed.
    """
    require_fx_traceback("preserve_node_meta", "set_current_meta")
    require_bool(tag_forward, where="preserve_meta_compiler", arg="tag_forward")
    check_num_fwd_outputs(num_fwd_outputs, "preserve_meta_compiler")

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> InterpretedGraph:
        require_graph_module(gm, where="preserve_meta_compiler", arg="gm")
        report = None
        if tag_forward:
            unmark_forward_graph(gm)
            report = tag_saved_outputs(gm, num_fwd_outputs=num_fwd_outputs)
            log.debug("preserve_meta_compiler tagged %s", report)
            # the replay reads this graph again to name what it saves fewer (_unread_saves)
            register_first_forward(gm.graph)
        else:
            release_recomputed_saves(gm)
            mark_backward_graph(gm)
        return InterpretedGraph(gm, report)

    return compile_graph
