"""``schedule_chunk_overlap``: the pipeline order, the contract and its refusals, on hand-built
chunked graphs (the bitwise run on real EP models is ``tests/test_ep_schedule.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ap_epchunk import ChunkConfig, chunk_pass, schedule_chunk_overlap

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _moe_like(fake_graph: Any, *, backward_too: bool = False) -> torch.fx.GraphModule:
    """A region with two exchanges per chunk: router -> dispatch -> experts -> combine -> out,
    and a filler branch (a shared expert) that needs no exchange."""
    b = fake_graph()
    u0 = b.unbacked(16)
    x = b.placeholder("x", b.fake(u0, 4))
    w = b.placeholder("w", b.fake(4, 4))
    r = b.op(aten.relu.default, x, fqn="layers.0.moe")
    d = b.op(c10d.all_to_all_single.default, r, [u0], [u0], "0", fqn="layers.0.moe")
    dw = b.op(c10d.wait_tensor.default, d, fqn="layers.0.moe")
    e = b.op(aten.mm.default, dw, w, fqn="layers.0.moe.experts")
    e2 = b.op(aten.sigmoid.default, e, fqn="layers.0.moe.experts")
    c = b.op(c10d.all_to_all_single.default, e2, [u0], [u0], "0", fqn="layers.0.moe")
    cw = b.op(c10d.wait_tensor.default, c, fqn="layers.0.moe")
    s = b.op(aten.mm.default, x, w, fqn="layers.0.moe.shared")
    out = b.op(aten.add.Tensor, cw, s, fqn="layers.0.moe")
    return b.module(b.op(aten.relu.default, out, fqn="head"))


def _order(gm: torch.fx.GraphModule) -> dict[str, int]:
    return {n.name: i for i, n in enumerate(gm.graph.nodes)}


@pytest.mark.parametrize("n", [2, 4])
def test_pipeline_launches_next_chunk_before_computing_this_one(fake_graph: Any, n: int) -> None:
    gm = _moe_like(fake_graph)
    chunk_pass(gm, ChunkConfig(("layers.*.moe",), num_chunks=n))
    report = schedule_chunk_overlap(gm)
    gm.graph.lint()
    (region,) = report.regions
    assert region.reason is None
    assert region.exchanges_paired == 2
    pos = _order(gm)
    # chunk c's expert compute runs while chunk c+1's dispatch is in flight
    for c in range(n - 1):
        assert pos[f"all_to_all_single_default_chunk{c + 1}"] < pos[f"mm_default_chunk{c}"]
        assert pos[f"mm_default_chunk{c}"] < pos[f"wait_tensor_default_chunk{c + 1}"]
    assert region.exposed_before == 2 * n
    assert region.exposed_after < region.exposed_before
