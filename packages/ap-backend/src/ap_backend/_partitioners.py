"""Partitioner selection, and a measuring wrapper that summarises every partition's saved set
with the same yardstick the first compilation uses (so "first vs second" compares like with
like, whichever partitioner ran)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import ap_partitioner
import torch.fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files

from ap_backend._options import PartitionerChoice
from ap_backend._saved import SavedSummary, summarize_forward_saves

__all__ = ["MeasuringPartitioner", "make_partitioner"]


def make_partitioner(
    choice: PartitionerChoice, on_report: Callable[[Any], None]
) -> CustomPartitionerFn:
    if choice == "save_all":
        return ap_partitioner.SaveAllPartitioner(on_report=on_report)
    if choice == "min_cut":
        return ap_partitioner.MinCutPartitioner(on_report=on_report)
    assert isinstance(choice, CustomPartitionerFn)
    return choice


class MeasuringPartitioner(CustomPartitionerFn):
    """Delegates to ``inner`` and reports a :class:`SavedSummary` of its forward module."""

    def __init__(self, inner: CustomPartitionerFn, on_saved: Callable[[SavedSummary], None]):
        self.inner = inner
        self.on_saved = on_saved

    def __call__(
        self, gm: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        num_fwd_outputs = int(kwargs["num_fwd_outputs"])
        fw, bw = self.inner(gm, joint_inputs, **kwargs)
        self.on_saved(summarize_forward_saves(fw, num_fwd_outputs))
        return fw, bw

    def uuid(self) -> Any:
        """Changes with the inner partitioner's uuid and with this file."""
        mine = get_hash_for_files((__file__,))
        inner = self.inner.uuid()
        return hashlib.sha256(repr((mine, inner)).encode()).hexdigest()
