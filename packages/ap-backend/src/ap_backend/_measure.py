"""Measure a partitioner's saved set without Inductor codegen.

Runs AOTAutograd with identity fw/bw compilers but Inductor's own ``partition_fn`` (so the
joint graph gets the same Inductor joint passes as a real compile) under the chosen
partitioner, the optional AC joint pass and ``wait_tensor_dce()``. Cheap enough to put the
min-cut+AC saved set next to the backend's in the demo table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ap_tags
import torch
import torch.fx
from ap_partitioner import wait_tensor_dce
from torch import nn

from ap_backend._options import validate_options
from ap_backend._partitioners import MeasuringPartitioner, make_partitioner
from ap_backend._saved import SavedSummary

__all__ = ["measure_saved"]


def _identity_compiler(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    """Runs the graph as is, with AOTAutograd's boxed calling convention."""

    def run(args: list[Any]) -> Any:
        return gm(*args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def measure_saved(
    module: nn.Module,
    example_args: Sequence[Any],
    *,
    partitioner: str | Any = "min_cut",
    enable_ac: bool = True,
    ac_stage_size_gib: float | str = "auto",
) -> SavedSummary:
    """Trace ``module(*example_args)`` forward+backward with Dynamo + AOTAutograd and return
    what ``partitioner`` saves for backward (the same measure as ``precompile`` and the
    backend use)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor import compile_fx as cfx

    opts = validate_options(
        enable_ac=enable_ac,
        ac_stage_size_gib=ac_stage_size_gib,
        overlap_scheduling=False,
        bucketing=None,
        ep_chunk=None,
        partitioner=partitioner,
    )
    sink: list[SavedSummary] = []
    part = MeasuringPartitioner(make_partitioner(opts.partitioner, lambda _r: None), sink.append)
    joint: dict[str, Any] = {}
    if opts.enable_ac:
        joint["joint_custom_pass"] = ap_tags.ac_joint_pass(opts.ac_stage_size_gib)
    backend = aot_autograd(
        fw_compiler=_identity_compiler,
        bw_compiler=_identity_compiler,
        partition_fn=cfx.partition_fn,
    )
    with (
        wait_tensor_dce(),
        torch._functorch.config.patch(joint),
        torch._inductor.config.patch({"custom_partitioner_fn": part}),
    ):
        out = torch.compile(module, backend=backend)(*example_args)
    if isinstance(out, torch.Tensor) and out.requires_grad:
        out.sum().backward()  # type: ignore[no-untyped-call]
    module.zero_grad(set_to_none=True)
    if not sink:
        raise RuntimeError("measure_saved: no joint graph was partitioned (no output grad?)")
    return sink[-1]
