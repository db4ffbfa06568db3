"""Validation of one partitioner call, before any graph is touched.

Inductor and AOTAutograd call a partitioner as ``fn(gm, joint_inputs, *, num_fwd_outputs,
static_lifetime_input_indices=..., compiler=...)``. A bad call fails here, naming the
partitioner, the argument and what was passed: a wrong type raises ``TypeError``, a value out of
range ``ValueError`` (the convention of :mod:`ap_tags.checks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch.fx as fx
from ap_tags.checks import describe, require_graph_module, require_instance, require_int


class PartitionCall(NamedTuple):
    """One validated partitioner call."""

    gm: fx.GraphModule
    joint_inputs: Sequence[object]
    num_fwd_outputs: int
    static: list[int]  # static_lifetime_input_indices
    compiler: str


def check_call(
    owner: str, gm: object, joint_inputs: object, kwargs: dict[str, Any]
) -> PartitionCall:
    """Validate one partitioner call (``kwargs`` are the call's keywords; the known ones are
    popped).

    Inductor/AOTAutograd pass ``num_fwd_outputs`` (required), ``static_lifetime_input_indices``
    and ``compiler`` (which ``default_partition`` does not accept, so it is popped here).
    """
    module = require_graph_module(gm, where=owner, arg="gm")
    if not isinstance(joint_inputs, Sequence) or isinstance(joint_inputs, str | bytes):
        raise TypeError(
            f"{owner}: joint_inputs must be a list or tuple, got {describe(joint_inputs)}"
        )
    if "num_fwd_outputs" not in kwargs:
        raise TypeError(f"{owner}: call is missing the required keyword 'num_fwd_outputs'")
    num_fwd_outputs = require_int(kwargs.pop("num_fwd_outputs"), where=owner, arg="num_fwd_outputs")
    outputs = _output_count(module)
    if not 0 <= num_fwd_outputs <= outputs:
        raise ValueError(
            f"{owner}: num_fwd_outputs={num_fwd_outputs} is outside [0, {outputs}] "
            f"(the joint graph has {outputs} outputs)"
        )
    static = kwargs.pop("static_lifetime_input_indices", None)
    if static is None:
        static = []
    if not isinstance(static, list | tuple) or any(
        isinstance(i, bool) or not isinstance(i, int) for i in static
    ):
        raise TypeError(
            f"{owner}: static_lifetime_input_indices must be a list of ints, got {static!r}"
        )
    compiler = require_instance(
        kwargs.pop("compiler", "inductor"), str, where=owner, arg="compiler", expected="a str"
    )
    return PartitionCall(module, joint_inputs, num_fwd_outputs, list(static), compiler)


def _output_count(gm: fx.GraphModule) -> int:
    outputs = gm.graph.find_nodes(op="output")
    if not outputs:
        return 0
    args = outputs[0].args[0]
    return len(args) if isinstance(args, list | tuple) else 1
