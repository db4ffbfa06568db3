"""FSDP all-gather chain detection and tagging on hand-built graphs."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
from ap_tags import FSDP_AC_GRAPH_ID, mark_fsdp_all_gather_recomputation
from torch.utils.checkpoint import CheckpointPolicy

aten = torch.ops.aten
prims = torch.ops.prims
MUST_RECOMPUTE = CheckpointPolicy.MUST_RECOMPUTE
MUST_SAVE = CheckpointPolicy.MUST_SAVE


def _tags(gm: torch.fx.GraphModule) -> dict[str, tuple[Any, Any]]:
    return {
        n.name: (n.meta["recompute"], n.meta.get("ac_graph_id"))
        for n in gm.graph.nodes
        if "recompute" in n.meta
    }


def _recomputed(*names: str) -> dict[str, tuple[Any, Any]]:
    return {n: (MUST_RECOMPUTE, FSDP_AC_GRAPH_ID) for n in names}


def test_plain_chain(build: Any) -> None:
    b = build()
    w, x = b.ph("w"), b.ph("x")
    wait = b.wait(b.all_gather(w))
    mm = b.op(aten.mm.default, (x, wait), "mm")
    gm = b.done(mm)
    report = mark_fsdp_all_gather_recomputation(gm.graph)
    assert _tags(gm) == _recomputed("ag", "wait")
    assert report.chains_found == 1 and report.nodes_tagged == 2
    chain = report.chains[0]
    assert (chain.placeholder, chain.all_gather, chain.wait) == ("w", "ag", ("wait",))
    assert "recompute" not in w.meta  # the placeholder is never tagged


def test_two_casts_before_all_gather_are_both_tagged(build: Any) -> None:
    b = build()
    w, x = b.ph("w"), b.ph("x")
    c1 = b.op(aten._to_copy.default, (w,), "to_copy")
    c2 = b.op(prims.convert_element_type.default, (c1, torch.bfloat16), "convert")
    wait = b.wait(b.all_gather(c2))
    gm = b.done(b.op(aten.mm.default, (x, wait), "mm"))
    report = mark_fsdp_all_gather_recomputation(gm)
    assert _tags(gm) == _recomputed("to_copy", "convert", "ag", "wait")
    assert report.chains[0].casts == ("to_copy", "convert")
    assert "recompute" not in w.meta


def test_slice_and_view_after_wait_are_tagged_up_to_multi_input_consumer(build: Any) -> None:
    b = build()
    w, x = b.ph("w"), b.ph("x")
    wait = b.wait(b.all_gather(w))
    sl = b.op(aten.slice.Tensor, (wait, 0, 0, 8), "sl")
    v = b.op(aten.view.default, (sl, [8, 4]), "view")
    mm = b.op(aten.mm.default, (x, v), "mm")
    relu = b.op(aten.relu.default, (mm,), "relu")
    gm = b.done(relu)
    mark_fsdp_all_gather_recomputation(gm)
    assert _tags(gm) == _recomputed("ag", "wait", "sl", "view")


def test_fan_out_after_wait_tags_every_branch(build: Any) -> None:
    b = build()
    w, x, y = b.ph("w"), b.ph("x"), b.ph("y")
    wait = b.wait(b.all_gather(w))
    t = b.op(aten.t.default, (wait,), "t")
    sl = b.op(aten.slice.Tensor, (wait, 0, 0, 4), "sl")
    p = b.op(aten.permute.default, (sl, [1, 0]), "permute")
    mm1 = b.op(aten.mm.default, (x, t), "mm1")
    mm2 = b.op(aten.mm.default, (y, p), "mm2")
    gm = b.done(mm1, mm2)
    report = mark_fsdp_all_gather_recomputation(gm)
    assert _tags(gm) == _recomputed("ag", "wait", "t", "sl", "permute")
    assert set(report.chains[0].views) == {"t", "sl", "permute"}


def test_backward_consumers_are_not_part_of_the_chain(build: Any) -> None:
    b = build()
    w, x = b.ph("w"), b.ph("x")
    wait = b.wait(b.all_gather(w))
    mm = b.op(aten.mm.default, (x, wait), "mm")
    bw_t = b.op(aten.t.default, (wait,), "bw_t")
    bw_t.meta["partitioner_tag"] = "is_backward"
    gm = b.done(mm, bw_t)
    mark_fsdp_all_gather_recomputation(gm)
    assert _tags(gm) == _recomputed("ag", "wait")


def test_multi_input_all_gather_is_left_untouched(build: Any) -> None:
    b = build()
    a, c, x = b.ph("a"), b.ph("c"), b.ph("x")
    mm0 = b.op(aten.mm.default, (a, c), "mm0")
    cast = b.op(aten._to_copy.default, (mm0,), "cast")
    wait = b.wait(b.all_gather(cast))
    gm = b.done(b.op(aten.mm.default, (x, wait), "mm"))
    report = mark_fsdp_all_gather_recomputation(gm)
    assert _tags(gm) == {}
    assert report.chains_found == 0 and report.skipped_all_gathers == ("ag",)
    assert not any("ac_graph_id" in n.meta for n in gm.graph.nodes)


def test_all_gather_without_wait_or_placeholder_is_not_fsdp(build: Any) -> None:
    b = build()
    x = b.ph("x")
    full = b.op(aten.full.default, ([4, 8], 1.0), "full")
    wait = b.wait(b.all_gather(full))
    ag2 = b.all_gather(x, "ag2")
    gm = b.done(b.op(aten.mm.default, (x, wait), "mm"), ag2)
    report = mark_fsdp_all_gather_recomputation(gm)
    assert _tags(gm) == {}
    assert report.skipped_all_gathers == ("ag", "ag2")


def test_process_group_passed_as_a_node_still_counts_as_fsdp(build: Any) -> None:
    b = build()
    w, x, pg = b.ph("w"), b.ph("x"), b.ph("pg")
    ag = b.op(torch.ops._c10d_functional.all_gather_into_tensor.default, (w, 4, pg), "ag")
    wait = b.wait(ag)
    gm = b.done(b.op(aten.mm.default, (x, wait), "mm"))
    mark_fsdp_all_gather_recomputation(gm)
    assert _tags(gm) == _recomputed("ag", "wait")


def test_no_tags_without_fsdp_pattern(build: Any) -> None:
    b = build()
    x, y = b.ph("x"), b.ph("y")
    gm = b.done(b.op(aten.mm.default, (x, y), "mm"))
    report = mark_fsdp_all_gather_recomputation(gm)
    assert _tags(gm) == {} and report.chains_found == 0 and report.nodes_tagged == 0


def test_no_reshard_after_forward_saves_last_non_view_node(build: Any) -> None:
    b = build()
    w, x = b.ph("w"), b.ph("x")
    cast = b.op(prims.convert_element_type.default, (w, torch.bfloat16), "convert")
    wait = b.wait(b.all_gather(cast))
    v = b.op(aten.view.default, (wait, [8, 16]), "view")
    t = b.op(aten.t.default, (v,), "t")
    gm = b.done(b.op(aten.mm.default, (x, t), "mm"))
    report = mark_fsdp_all_gather_recomputation(gm, reshard_after_forward=False)
    assert _tags(gm) == {"wait": (MUST_SAVE, FSDP_AC_GRAPH_ID)}
    assert report.tagged_nodes == ("wait",) and not report.reshard_after_forward


def test_no_reshard_save_picks_non_view_producer_per_branch(build: Any) -> None:
    b = build()
    w, x, y = b.ph("w"), b.ph("x"), b.ph("y")
    wait = b.wait(b.all_gather(w))
    cast = b.op(aten._to_copy.default, (wait,), "cast_after")
    t = b.op(aten.t.default, (cast,), "t")
    v = b.op(aten.view.default, (wait, [8, 16]), "view")
    gm = b.done(b.op(aten.mm.default, (x, t), "mm1"), b.op(aten.mm.default, (y, v), "mm2"))
    mark_fsdp_all_gather_recomputation(gm, reshard_after_forward=False)
    assert _tags(gm) == {
        "cast_after": (MUST_SAVE, FSDP_AC_GRAPH_ID),
        "wait": (MUST_SAVE, FSDP_AC_GRAPH_ID),
    }
    assert "recompute" not in w.meta


@pytest.mark.skipif(
    not hasattr(torch.ops._c10d_functional, "wait_tensors"), reason="wait_tensors is 2.15+"
)
def test_wait_tensors_single_input_counts_as_wait(build: Any) -> None:
    b = build()
    w, x = b.ph("w"), b.ph("x")
    ag = b.all_gather(w)
    waits = b.op(torch.ops._c10d_functional.wait_tensors.default, ([ag],), "waits")
    item = b.op(operator.getitem, (waits, 0), "item")
    gm = b.done(b.op(aten.mm.default, (x, item), "mm"))
    report = mark_fsdp_all_gather_recomputation(gm)
    assert _tags(gm) == _recomputed("ag", "waits", "item")
    assert report.chains[0].wait == ("waits", "item")


def test_bad_option_refused_before_any_write(build: Any) -> None:
    b = build()
    w, x = b.ph("w"), b.ph("x")
    gm = b.done(b.op(aten.mm.default, (x, b.wait(b.all_gather(w))), "mm"))
    with pytest.raises(TypeError, match="reshard_after_forward"):
        mark_fsdp_all_gather_recomputation(gm, reshard_after_forward="yes")  # type: ignore[arg-type]
    assert _tags(gm) == {}
