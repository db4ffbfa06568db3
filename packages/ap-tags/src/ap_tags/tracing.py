"""What a compile's tracing state tells the ap passes, read one way for all of them.

Two facts several packages need, kept here so their rule lives in one place:

* **Which flat argument a joint-graph placeholder stands for** (``aot_input_index``).
  AOTAutograd describes each placeholder (``meta["desc"]``); a DTensor argument becomes one
  placeholder per inner tensor, so "placeholder *i* is argument *i*" is wrong as soon as a
  parameter is a tensor subclass. ap-epchunk pairs chunk marks with arguments by it; ap-backend
  counts how many arguments a nested region's joint stands for by it.
* **Data-dependent reads a compile already accepted** (``scalar_outputs_allowed``). A
  precompiled graph may read split sizes into Python (``.tolist()``), recorded once as
  unbacked symbols; a later fake propagation through the same graph (Dynamo's replay, then
  Inductor's) must accept those reads again, whatever ``capture_scalar_outputs`` says, because
  the user wrote no new read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch.fx

from . import _compat
from .checks import require_node

__all__ = ["aot_input_index", "scalar_outputs_allowed"]


def aot_input_index(node: torch.fx.Node, *, through_subclasses: bool = False) -> int | None:
    """The compiled function's flat argument index placeholder ``node`` stands for as a whole
    (``PlainAOTInput(idx)``), or None: a parameter, buffer, size, tangent, or a graph without
    descriptors. ``through_subclasses=True`` also answers for a tensor subclass's inner tensor
    (the argument it belongs to)."""
    require_node(node, where="aot_input_index")
    return _compat.aot_input_index(node, through_subclasses=through_subclasses)


def scalar_outputs_allowed(values: Sequence[Any]) -> contextlib.AbstractContextManager[Any]:
    """Within the block, the fake mode tracing ``values`` lets ``_local_scalar_dense`` make
    unbacked symbols (``FakeTensorMode.allow_scalar_outputs``), restored on exit; a no-op when
    ``values`` carry no fake mode with a shape env."""
    return _compat.scalar_outputs_allowed(values)
