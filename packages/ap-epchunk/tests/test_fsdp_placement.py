"""``schedule_chunk_overlap(place_fsdp_collectives=...)``: FSDP collectives in flight inside a
chunked region's span move to the dense stretch around it, on hand-built chunked graphs (the
bitwise run on real EP models, where the backward re-gathers a MoE layer's router and shared
expert weights inside the span, is ``tests/test_ep_schedule.py``)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from ap_epchunk import ChunkConfig, chunk_pass, schedule_chunk_overlap

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _moe_with_fsdp(
    fake_graph: Any, *, backward: bool = False, collective: str = "all_gather"
) -> torch.fx.GraphModule:
    """A dense op, then a MoE region (router -> dispatch -> experts -> combine, and a shared
    expert) chunked in 2; then an FSDP collective put inside the region's span, right after its
    first exchange launch (where it competes with the exchanges):

    * ``"all_gather"``: the shared expert's weight, gathered from its shard (a placeholder,
      through a cast), as FSDP re-gathers a weight for the backward;
    * ``"pinned"``: the same, and the shard is written (``copy_``) inside the span before the
      cast reads it, so the cast must stay behind the write;
    * ``"reduce_scatter"``: a gradient (a placeholder doubled inside the span) reduce-scattered
      and returned.
    """
    b = fake_graph()
    op = b.op
    b.op = lambda *a, **k: op(*a, backward=backward, **k)
    u0 = b.unbacked(16)
    x = b.placeholder("x", b.fake(u0, 4))
    w = b.placeholder("w", b.fake(4, 4))
    shard = b.placeholder("shard", b.fake(2, 4))
    grad = b.placeholder("grad", b.fake(4, 4))
    h = b.op(aten.relu.default, x, fqn="layers.0.attention")
    r = b.op(aten.relu.default, h, fqn="layers.0.moe")
    d = b.op(c10d.all_to_all_single.default, r, [u0], [u0], "0", fqn="layers.0.moe")
    dw = b.op(c10d.wait_tensor.default, d, fqn="layers.0.moe")
    e = b.op(aten.sigmoid.default, b.op(aten.mm.default, dw, w, fqn="layers.0.moe.experts"))
    c = b.op(c10d.all_to_all_single.default, e, [u0], [u0], "0", fqn="layers.0.moe")
    cw = b.op(c10d.wait_tensor.default, c, fqn="layers.0.moe")
    cast = b.op(aten.mul.Tensor, shard, 1.0)
    gather = b.op(c10d.all_gather_into_tensor.default, cast, 2, "0")
    gathered = b.op(c10d.wait_tensor.default, gather)
    s = b.op(aten.mm.default, h, gathered, fqn="layers.0.moe.shared")
    out = b.op(aten.add.Tensor, cw, s, fqn="layers.0.moe")
    outs = [b.op(aten.relu.default, out, fqn="head")]
    fsdp = [cast.name, gather.name, gathered.name]
    if collective == "reduce_scatter":
        doubled = b.op(aten.mul.Tensor, grad, 2.0)
        rs = b.op(c10d.reduce_scatter_tensor.default, doubled, "sum", 2, "0")
        rw = b.op(c10d.wait_tensor.default, rs)
        outs.append(rw)
        fsdp = [doubled.name, rs.name, rw.name]
    gm = b.module(*outs)
    chunk_pass(gm, ChunkConfig(("layers.*.moe",), num_chunks=2))
    graph = gm.graph
    by_name = {n.name: n for n in graph.nodes}
    shard = by_name["shard"]
    first_launch = next(n for n in graph.nodes if "all_to_all_single" in str(n.target))
    anchor = first_launch
    if collective == "pinned":
        with graph.inserting_after(anchor):
            anchor = graph.call_function(aten.copy_.default, (shard, shard))
        anchor.meta = {"val": shard.meta["val"], "autograd_backward": backward}
    for name in fsdp:
        node = by_name[name]
        anchor.append(node)
        anchor = node
    graph.lint()
    gm.recompile()
    return gm


def _pos(gm: torch.fx.GraphModule) -> dict[str, int]:
    return {n.name: i for i, n in enumerate(gm.graph.nodes)}


def _span(gm: torch.fx.GraphModule) -> tuple[int, int]:
    """First and last position of the region's body (``ap_chunk_index`` without glue)."""
    body = [
        i
        for i, n in enumerate(gm.graph.nodes)
        if isinstance(n.meta.get("custom"), dict)
        and n.meta["custom"].get("ap_chunk_index") is not None
        and not n.meta["custom"].get("ap_chunk_glue")
    ]
    return min(body), max(body)


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_all_gather_in_the_span_moves_to_the_dense_stretch_before_it(
    fake_graph: Any, backward: bool
) -> None:
    gm = _moe_with_fsdp(fake_graph, backward=backward)
    lo, hi = _span(gm)
    assert lo < _pos(gm)["all_gather_into_tensor_default"] < hi  # competing, as built
    report = schedule_chunk_overlap(gm)
    gm.graph.lint()
    (region,) = report.regions
    assert (region.reason, region.fsdp_moved, region.fsdp_left) == (None, 1, ())
    pos = _pos(gm)
    lo, _ = _span(gm)
    # launched (with its cast) at the start of the dense stretch, completed before the span
    assert pos["mul_tensor"] < pos["all_gather_into_tensor_default"] < pos["relu_default"]
    assert pos["relu_default"] < pos["wait_tensor_default_2"] < lo


def test_switched_off_the_all_gather_stays_in_the_span(fake_graph: Any) -> None:
    gm = _moe_with_fsdp(fake_graph)
    report = schedule_chunk_overlap(gm, place_fsdp_collectives=False)
    (region,) = report.regions
    assert (region.reason, region.fsdp_moved, region.fsdp_left) == (None, 0, ())
    lo, hi = _span(gm)
    assert lo < _pos(gm)["all_gather_into_tensor_default"] < hi


def test_a_write_the_all_gather_reads_keeps_it_in_the_span(fake_graph: Any) -> None:
    gm = _moe_with_fsdp(fake_graph, collective="pinned")
    report = schedule_chunk_overlap(gm)
    gm.graph.lint()
    (region,) = report.regions
    assert region.reason is None and region.fsdp_moved == 0
    (left,) = region.fsdp_left
    assert re.fullmatch(
        r"all_gather_into_tensor_default: 'mul_tensor' must stay behind 'copy__default' .*", left
    )
    pos = _pos(gm)
    lo, hi = _span(gm)
    assert pos["copy__default"] < pos["mul_tensor"] < pos["all_gather_into_tensor_default"] < hi


def test_reduce_scatter_in_the_span_moves_after_it(fake_graph: Any) -> None:
    gm = _moe_with_fsdp(fake_graph, collective="reduce_scatter")
    report = schedule_chunk_overlap(gm)
    gm.graph.lint()
    (region,) = report.regions
    # the all-gather moves before the span, the reduce-scatter after it
    assert (region.reason, region.fsdp_moved, region.fsdp_left) == (None, 2, ())
    pos = _pos(gm)
    _, hi = _span(gm)
    assert hi < pos["reduce_scatter_tensor_default"] < pos["wait_tensor_default_3"]
    # the doubled gradient it reads stays where it was (inside the span: not its reader)
    assert pos["mul_tensor_1"] < hi


def test_bad_place_fsdp_collectives_names_the_argument() -> None:
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    with pytest.raises(TypeError, match="place_fsdp_collectives"):
        schedule_chunk_overlap(gm, place_fsdp_collectives="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ChunkConfig.*place_fsdp_collectives"):
        ChunkConfig(("layers.*",), place_fsdp_collectives=1)  # type: ignore[arg-type]
