"""The first compilation: export the joint graph, tag it, partition it, and hand back a module
that a second ``torch.compile`` can retrace with the tags intact.

Why this shape: the first partition's decisions (FSDP all-gathers recomputed, everything else
as torch's ``default_partition`` saved it) must survive into the second compile. ap-tags'
``preserve_meta_compiler`` runs the partitioned graphs through an FX interpreter under
``preserve_node_meta``; the callable returned by ``aot_compile_joint_with_descriptors`` is
``nonstrict_trace``'d, so Dynamo does not inline it and AOTAutograd re-executes those
interpreters while tracing, copying ``custom``/``recompute`` onto every retraced node.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import ap_epchunk
import ap_tags
import torch.fx
from ap_tags.checks import require_bool, require_callable, require_instance
from torch import nn

from ap_backend import _compat
from ap_backend._artifacts import emit_json
from ap_backend._partitioners import JointPass, partitioning
from ap_backend._saved import SavedSummary, summarize_forward_saves

__all__ = ["PrecompiledModule", "precompile"]

log = logging.getLogger(__name__)


class PrecompiledModule(nn.Module):
    """Calls the first compilation's callable with the wrapped module's parameters and buffers
    (in the exported order) followed by the user's arguments. ``module`` stays a submodule, so
    ``parameters()``/``state_dict()``/optimizers see the same (sharded) tensors.

    ``first_partition`` summarises what the first partition saved for backward."""

    def __init__(
        self,
        module: nn.Module,
        compiled_fn: Callable[..., Any],
        param_fqns: Sequence[str],
        buffer_fqns: Sequence[str],
        first_partition: SavedSummary,
        fsdp_report: Any,
    ) -> None:
        super().__init__()
        self.module = module
        self._compiled_fn = compiled_fn
        self._param_fqns = tuple(param_fqns)
        self._buffer_fqns = tuple(buffer_fqns)
        self.first_partition = first_partition
        self.fsdp_report = fsdp_report

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        params = [self.module.get_parameter(n) for n in self._param_fqns]
        buffers = [self.module.get_buffer(n) for n in self._buffer_fqns]
        return self._compiled_fn(*params, *buffers, *args, **kwargs)


def _recording_default_partition(
    sink: list[SavedSummary],
    joint: torch.fx.GraphModule,
    joint_inputs: Any,
    **kwargs: Any,
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """torch's ``default_partition`` (the first compilation's partitioner), measured."""
    kwargs.pop("compiler", None)
    fw, bw = _compat.default_partition()(joint, joint_inputs, **kwargs)
    sink.append(summarize_forward_saves(fw, int(kwargs["num_fwd_outputs"])))
    return fw, bw


def precompile(
    module: nn.Module,
    example_args: Sequence[Any],
    *,
    reshard_after_forward: bool = True,
    joint_pass: JointPass | None = None,
) -> PrecompiledModule:
    """Run the first compilation of ``module`` on ``example_args`` and return a module that
    ``torch.compile(..., backend=autoparallel_backend())`` retraces with the tags intact.

    ``joint_pass(gm, joint_inputs) -> gm`` (e.g. ``ap_tags.ac_joint_pass(...)``) runs on the
    joint graph right before the first partition, as ``torch._functorch.config.
    joint_custom_pass`` would. ``reshard_after_forward=True`` tags every FSDP all-gather chain
    MUST_RECOMPUTE (the backward re-gathers); ``False`` saves the gathered weight instead.
    """
    where = "precompile"
    require_instance(module, nn.Module, where=where, arg="module", expected="an nn.Module")
    require_instance(
        example_args, (tuple, list), where=where, arg="example_args", expected="a tuple or list"
    )
    require_bool(reshard_after_forward, where=where, arg="reshard_after_forward")
    require_callable(joint_pass, where=where, arg="joint_pass", optional=True)
    export_joint, compile_joint = _compat.joint_export_api()
    args = tuple(example_args)
    summaries: list[SavedSummary] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(ap_tags.annotate_module_fqns(module))
        jd = export_joint(stack, module, args)
        # ep_chunk finds backward regions by this tag in the second compilation
        ap_epchunk.tag_backward_module_fqns(jd.graph_module.graph)
        fsdp_report = ap_tags.mark_fsdp_all_gather_recomputation(
            jd.graph_module.graph, reshard_after_forward=reshard_after_forward
        )
        with partitioning(None, joint_pass):
            compiled_fn = compile_joint(
                jd,
                partition_fn=functools.partial(_recording_default_partition, summaries),
                fw_compiler=ap_tags.preserve_meta_compiler(tag_forward=True),
                bw_compiler=ap_tags.preserve_meta_compiler(tag_forward=False),
            )
    if len(summaries) != 1:
        raise RuntimeError(
            f"precompile: expected one joint partition, saw {len(summaries)} (does the module's "
            "output require grad?)"
        )
    emit_json("ap_first_partition", summaries[0].to_dict())
    log.info(
        "precompile: first partition saved %d activations (%d bytes), %d all-gather outputs",
        summaries[0].count,
        summaries[0].nbytes,
        len(summaries[0].all_gather_outputs),
    )
    return PrecompiledModule(
        module, compiled_fn, jd.params_spec, jd.buffers_spec, summaries[0], fsdp_report
    )
