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
    """Delegates to ``inner`` and reports a :class:`SavedSummary` of its forward module.

    Inductor pickles the whole config -- this object included -- into its FX-graph cache key
    with a fast-mode pickler that rejects reference cycles, and the callbacks here point back
    at the backend that holds this partitioner. So the pickled state is just the ``uuid()``
    (what identifies the behaviour), and ``deepcopy`` shares the live instance.
    """

    def __init__(
        self, inner: CustomPartitionerFn, on_saved: Callable[[SavedSummary], None]
    ) -> None:
        self.inner: CustomPartitionerFn | None = inner
        self.on_saved = on_saved
        self._uuid: str | None = None

    def __call__(
        self, gm: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        if self.inner is None:
            raise RuntimeError("MeasuringPartitioner: an unpickled copy only carries its uuid")
        num_fwd_outputs = int(kwargs["num_fwd_outputs"])
        fw, bw = self.inner(gm, joint_inputs, **kwargs)
        self.on_saved(summarize_forward_saves(fw, num_fwd_outputs))
        return fw, bw

    def uuid(self) -> Any:
        """Changes with the inner partitioner's uuid and with this file."""
        if self.inner is None:
            return self._uuid
        mine = get_hash_for_files((__file__,))
        inner = self.inner.uuid()
        return hashlib.sha256(repr((mine, inner)).encode()).hexdigest()

    def __getstate__(self) -> dict[str, Any]:
        return {"uuid": self.uuid()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.inner = None
        self.on_saved = _ignore
        self._uuid = state["uuid"]

    def __deepcopy__(self, memo: dict[int, Any]) -> MeasuringPartitioner:
        return self


def _ignore(summary: SavedSummary) -> None:
    return None
