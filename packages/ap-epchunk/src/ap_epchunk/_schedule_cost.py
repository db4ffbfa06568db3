"""A rough clock for the overlap scheduler: when is an exchange in flight estimated to be done?

The scheduler (:mod:`ap_epchunk._schedule_order`) only asks one question of it: is the oldest
exchange in flight done by now, or is there time to fill? So the estimates need the right
*proportions*, not the right times: an exchange costs a latency plus its bytes over a link
bandwidth; a node costs a per-op overhead plus its output bytes over a memory bandwidth, a
matmul its flops over a compute rate. A size without a hint (a data-dependent row count) counts
as :data:`UNKNOWN_BYTES`. Nothing here changes a value: a bad estimate only gives a worse order.
"""

from __future__ import annotations

import torch
import torch.fx
from ap_tags.graph import is_collective, is_wait, node_nbytes, op_overload, size_hint

#: seconds: a collective's latency, and the link bandwidth (bytes/s) of its payload. An A/B
#: against 500 us (the order an exchange was exposed for unscheduled on the EP zoo models at 2
#: gloo ranks) was inconclusive at the machine's noise (benchmarks/RESULTS.md, issue 24)
LATENCY_S, LINK_BPS = 50e-6, 1e9
#: seconds per op (dispatch), memory bandwidth (bytes/s), matmul rate (flop/s)
OP_S, MEMORY_BPS, FLOPS = 5e-6, 5e9, 2e10
#: bytes assumed for a tensor whose size has no hint
UNKNOWN_BYTES = 64 * 1024

_MATMULS = ("mm", "addmm", "bmm", "_grouped_mm", "baddbmm")
_FREE = ("sym_size", "sym_stride", "sym_numel", "getitem", "view", "_unsafe_view", "alias")


def _bytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    return node_nbytes(node) or (UNKNOWN_BYTES if isinstance(val.numel(), torch.SymInt) else 0)


def _matmul_flops(node: torch.fx.Node) -> int | None:
    """``2 * M * N * K`` of a matmul from its output and first input's hinted sizes."""
    out, first = node.meta.get("val"), node.args[0] if node.args else None
    a = first.meta.get("val") if isinstance(first, torch.fx.Node) else None
    if not isinstance(out, torch.Tensor) or not isinstance(a, torch.Tensor) or not a.shape:
        return None
    numel, k = size_hint(out.numel()), size_hint(a.shape[-1])
    return None if numel is None or k is None else 2 * numel * k


def op_seconds(node: torch.fx.Node) -> float:
    """Estimated run time of one (non-collective) node."""
    op = op_overload(node)
    name = str(op._schema.name).split("::")[-1] if op is not None else str(node.target)
    if node.op != "call_function" or any(name.endswith(f) for f in _FREE):
        return 0.0
    if name in _MATMULS:
        flops = _matmul_flops(node)
        if flops is not None:
            return OP_S + flops / FLOPS
    return OP_S + _bytes(node) / MEMORY_BPS


def exchange_seconds(launch: torch.fx.Node) -> float:
    """Estimated time from a collective's launch until its result is there."""
    payload = max([_bytes(launch), *(_bytes(a) for a in launch.all_input_nodes)])
    return LATENCY_S + payload / LINK_BPS


class Clock:
    """The estimated time of the order emitted so far, and when each launch completes."""

    def __init__(self) -> None:
        self.now = 0.0
        self.completes: dict[torch.fx.Node, float] = {}
        #: launch -> its position among the launches emitted (waits go oldest first)
        self.launched: dict[torch.fx.Node, int] = {}

    def emit(self, node: torch.fx.Node) -> None:
        if is_collective(node):
            self.launched[node] = len(self.launched)
            self.now += OP_S
            self.completes[node] = self.now + exchange_seconds(node)
        elif is_wait(node):
            launch = node.all_input_nodes[0] if node.all_input_nodes else None
            self.now = max(self.now, self.completes.get(launch, self.now))  # type: ignore[arg-type]
        else:
            self.now += op_seconds(node)

    def done(self, launch: torch.fx.Node | None) -> bool:
        """Is ``launch`` estimated complete (True for one launched outside the window)?"""
        return launch is None or self.completes.get(launch, self.now) <= self.now
