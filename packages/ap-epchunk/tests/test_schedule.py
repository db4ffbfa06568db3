"""``schedule_chunk_overlap``: the pipeline order, the contract and its refusals, on hand-built
chunked graphs (the bitwise run on real EP models is ``tests/test_ep_schedule.py``)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from ap_epchunk import ChunkConfig, chunk_pass, schedule_chunk_overlap

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _moe_like(fake_graph: Any, *, backward: bool = False) -> torch.fx.GraphModule:
    """A region with two exchanges per chunk: router -> dispatch -> experts -> combine -> out,
    and a filler branch (a shared expert) that needs no exchange; ``backward``: every op is
    a backward op (a backward region)."""
    b = fake_graph()
    op = b.op
    b.op = lambda *a, **k: op(*a, backward=backward, **k)
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


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("n", [2, 4])
def test_pipeline_launches_next_chunk_before_computing_this_one(
    fake_graph: Any, n: int, backward: bool
) -> None:
    gm = _moe_like(fake_graph, backward=backward)
    chunk_pass(gm, ChunkConfig(("layers.*.moe",), num_chunks=n))
    report = schedule_chunk_overlap(gm)
    gm.graph.lint()
    (region,) = report.regions
    assert (region.reason, region.backward) == (None, backward)
    assert region.exchanges_paired == 2
    pos = _order(gm)
    # forward: chunks 0..N-1; backward: N-1..0 (the order autograd runs chunk backwards)
    chunks = list(reversed(range(n))) if backward else list(range(n))
    for a, b in zip(chunks, chunks[1:], strict=False):
        # chunk a's expert compute runs while chunk b's dispatch is in flight
        assert pos[f"all_to_all_single_default_chunk{b}"] < pos[f"mm_default_chunk{a}"]
        assert pos[f"mm_default_chunk{a}"] < pos[f"wait_tensor_default_chunk{b}"]
    assert region.exposed_before == 2 * n
    assert region.exposed_after < region.exposed_before


def _hand_chunked(
    fake_graph: Any, *, groups: tuple[str, str] = ("0", "0"), cross: bool = False
) -> torch.fx.GraphModule:
    """Two chunks of ``relu -> exchange -> wait -> mm`` tagged as ``chunk_pass`` tags them,
    with each chunk's exchange on ``groups[i]``; ``cross``: chunk 1's exchange reads chunk 0's
    exchanged tokens (pairing the two exchanges would need a cycle)."""
    b = fake_graph()
    xs = [b.placeholder(f"x{i}", b.fake(4, 4)) for i in range(2)]
    w = b.placeholder("w", b.fake(4, 4))
    outs, waits = [], []
    for i in range(2):
        r = b.op(aten.relu.default, xs[i])
        if cross and i == 1:
            r = b.op(aten.add.Tensor, r, waits[0])
        a = b.op(c10d.all_to_all_single.default, r, [2, 2], [2, 2], groups[i])
        waits.append(b.op(c10d.wait_tensor.default, a))
        outs.append(b.op(aten.mm.default, waits[i], w))
        for node in (r, a, waits[i], outs[i], *([r.args[0]] if cross and i == 1 else [])):
            node.meta["custom"] = {
                "module_fqn": "moe",
                "ap_chunk_region": "moe",
                "ap_chunk_index": i,
            }
    return b.module(b.op(aten.cat.default, outs))


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"groups": ("0", "1")}, r"chunks disagree in their exchange signature"),
        ({"cross": True}, r"pairing exchange 0 would need a cycle"),
    ],
    ids=["signature_mismatch", "pairing_cycle"],
)
def test_region_breaking_the_contract_is_left_as_it_was(
    fake_graph: Any, kwargs: dict[str, Any], reason: str
) -> None:
    gm = _hand_chunked(fake_graph, **kwargs)
    code = gm.code
    report = schedule_chunk_overlap(gm)
    assert gm.code == code
    (region,) = report.regions
    assert region.exchanges_paired == 0 and not report.scheduled
    assert region.reason is not None and re.search(reason, region.reason)
    with pytest.raises(ValueError, match=rf"region 'moe' \(forward\) left unscheduled: {reason}"):
        schedule_chunk_overlap(gm, strict=True)
    assert gm.code == code


def test_contract_met_by_the_hand_chunked_region(fake_graph: Any) -> None:
    gm = _hand_chunked(fake_graph)
    report = schedule_chunk_overlap(gm)
    (region,) = report.regions
    assert (region.reason, region.exchanges_paired, region.exposed_before) == (None, 1, 2)
    pos = _order(gm)
    # chunk 0 computes while chunk 1's exchange is in flight
    assert pos["all_to_all_single_default_1"] < pos["mm_default"] < pos["wait_tensor_default_1"]
    # chunk 1's relu runs under chunk 0's exchange, chunk 0's mm under chunk 1's
    assert region.exposed_after == 0


def test_a_failure_while_applying_restores_the_order(
    fake_graph: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    gm = _moe_like(fake_graph)
    chunk_pass(gm, ChunkConfig(("layers.*.moe",), num_chunks=2))
    order = [n.name for n in gm.graph.nodes]

    def broken_lint(self: torch.fx.Graph) -> None:
        raise RuntimeError("lint failed")

    monkeypatch.setattr(torch.fx.Graph, "lint", broken_lint)
    with pytest.raises(RuntimeError, match="lint failed"):
        schedule_chunk_overlap(gm)
    assert [n.name for n in gm.graph.nodes] == order


def test_mutations_keep_their_order(fake_graph: Any) -> None:
    """A mutation (``copy_`` into a buffer, late in the region) stays behind every read of the
    value it writes, although nothing else holds it there (it reads only placeholders)."""
    gm = _moe_like(fake_graph)
    chunk_pass(gm, ChunkConfig(("layers.*.moe",), num_chunks=2))
    graph = gm.graph
    buf = next(n for n in graph.nodes if n.name == "w")
    late = next(n for n in graph.nodes if n.name == "add_tensor_chunk0")
    with graph.inserting_before(late):
        copy = graph.call_function(aten.copy_.default, (buf, buf))
    copy.meta = dict(late.meta)
    report = schedule_chunk_overlap(gm)
    assert report.scheduled
    pos = _order(gm)
    readers = [n.name for n in buf.users if n is not copy]
    assert len(readers) == 4 and all(pos[r] < pos[copy.name] for r in readers)


def test_bad_arguments_name_the_argument() -> None:
    from ap_epchunk import exchange_lane

    with pytest.raises(TypeError, match="schedule_chunk_overlap"):
        schedule_chunk_overlap("graph")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="exchange_lane"):
        exchange_lane("graph")  # type: ignore[arg-type]
    for field in ("schedule_overlap", "exchange_lane"):
        with pytest.raises(TypeError, match=f"ChunkConfig.*{field}"):
            ChunkConfig(("layers.*",), **{field: "yes"})  # type: ignore[arg-type]
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    with pytest.raises(TypeError, match="strict"):
        schedule_chunk_overlap(gm, strict=1)  # type: ignore[arg-type]
    assert schedule_chunk_overlap(gm).regions == []  # nothing chunked: nothing to do


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_drain_runs_ready_filler_before_the_last_waits(
    fake_graph: Any, backward: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once every exchange is launched, work that needs none (the shared expert) goes before
    the combines' waits even where the cost model says every exchange is done (here: always):
    nothing after the waits could hide them."""
    from ap_epchunk._schedule_cost import Clock

    monkeypatch.setattr(Clock, "done", lambda self, launch: True)
    gm = _moe_like(fake_graph, backward=backward)
    chunk_pass(gm, ChunkConfig(("layers.*.moe",), num_chunks=2))
    schedule_chunk_overlap(gm)
    pos = _order(gm)
    first_wait = min(pos[f"wait_tensor_default_1_chunk{c}"] for c in range(2))
    last_launch = max(pos[f"all_to_all_single_default_1_chunk{c}"] for c in range(2))
    shared = [pos[f"mm_default_1_chunk{c}"] for c in range(2)]
    assert all(last_launch < s < first_wait for s in shared), (shared, last_launch, first_wait)
