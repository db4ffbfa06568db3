"""Partitioner selection, and a measuring wrapper that summarises every partition's saved set
with the same yardstick the first compilation uses (so "first vs second" compares like with
like, whichever partitioner ran)."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import ap_partitioner
import torch.fx
from ap_partitioner import wait_tensor_dce

from ap_backend import _compat
from ap_backend._options import Partitioner, PartitionerChoice
from ap_backend._saved import SavedSummary, summarize_forward_saves

__all__ = ["JointPass", "MeasuringPartitioner", "make_partitioner", "partitioning"]

#: ``joint_pass(gm, joint_inputs) -> gm``, run on the joint graph before it is partitioned.
JointPass = Callable[[torch.fx.GraphModule, Any], torch.fx.GraphModule]


def make_partitioner(
    choice: PartitionerChoice,
    on_report: Callable[[Any], None],
    activation_budget_bytes: int | None = None,
) -> Partitioner:
    if choice == "save_all":
        return ap_partitioner.SaveAllPartitioner(
            on_report=on_report, activation_budget_bytes=activation_budget_bytes
        )
    if choice == "min_cut":
        return ap_partitioner.MinCutPartitioner(on_report=on_report)
    assert not isinstance(choice, str)
    return choice


class MeasuringPartitioner:
    """Delegates to ``inner`` and reports a :class:`SavedSummary` of its forward module.

    A ``CustomPartitionerFn`` (registered with torch's ABC when first installed, see
    ``_compat.as_custom_partitioner``). Inductor pickles the whole config -- this object
    included -- into its FX-graph cache key with a fast-mode pickler that rejects reference
    cycles, and the callbacks here point back at the backend that holds this partitioner. So
    the pickled state is just the ``uuid()`` (what identifies the behaviour), and ``deepcopy``
    shares the live instance.

    ``joint_key`` identifies the joint pass the backend runs before this partitioner (AC
    staging, EP chunking): torch keys its FX-graph and AOTAutograd caches on this ``uuid()``
    but leaves ``joint_custom_pass`` out of the key (``torch._functorch.config.
    _save_config_ignore``), so without it a warm cache served a graph chunked in N = 2 to a
    backend asked for N = 4, and its joint pass never ran (the EP route matrix, model kit).
    """

    def __init__(
        self,
        inner: Partitioner,
        on_saved: Callable[[SavedSummary], None],
        joint_key: str = "",
    ) -> None:
        self.inner: Partitioner | None = inner
        self.on_saved = on_saved
        self.joint_key = joint_key
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
        """Changes with the inner partitioner's uuid, with this file and with ``joint_key``."""
        if self.inner is None:
            return self._uuid
        mine = _compat.hash_files((__file__,))
        inner = self.inner.uuid()
        return hashlib.sha256(repr((mine, inner, self.joint_key)).encode()).hexdigest()

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


@contextlib.contextmanager
def partitioning(partitioner: Partitioner | None, joint_pass: JointPass | None) -> Iterator[None]:
    """The scope in which AOTAutograd splits a joint graph, entered around every compile call
    that partitions (the backend, :func:`~ap_backend.measure_saved`, ``precompile``).

    ``joint_pass`` becomes ``torch._functorch.config.joint_custom_pass`` and ``partitioner``
    Inductor's ``custom_partitioner_fn`` (``None`` leaves either as it is), inside
    ap-partitioner's ``wait_tensor_dce()``. All three are needed only while the joint graph is
    split, which happens synchronously inside the compile call -- so they are config *patches*,
    restored on exit even when the compile raises, and never outlive it: a later plain
    ``torch.compile`` sees torch's own settings. (Under ``torch.compile`` the backend call runs
    inside Dynamo's compile lock, so two compiles in one process never interleave them.)
    """
    functorch = {} if joint_pass is None else {"joint_custom_pass": joint_pass}
    inductor = (
        {}
        if partitioner is None
        else {"custom_partitioner_fn": _compat.as_custom_partitioner(partitioner)}
    )
    with (
        wait_tensor_dce(),
        _compat.functorch_config_patch(functorch),
        _compat.inductor_config_patch(inductor),
    ):
        yield
