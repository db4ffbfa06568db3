"""The replay's working copy, DCE without CSE, and GC pause.

The prologue copies the joint, runs DCE on the copy only when there is dead code, and never
runs CSE (CSE would merge the retraced backward's recomputations into forward values and move
what the backward reads). Both paths must give the same partition and leave the caller's graph
(nodes and metas) exactly as it was.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import ap_tags
import pytest
import torch
import torch._functorch.partitioners as torch_partitioners
import torch.fx as fx
from ap_partitioner import PartitionReport, SaveAllPartitioner
from ap_partitioner._prologue import dce_would_remove_nothing, normalized_copy

aten = torch.ops.aten
Simple = Callable[..., fx.GraphModule]  # the ``simple`` fixture


def partition(gm: fx.GraphModule) -> tuple[fx.GraphModule, fx.GraphModule, PartitionReport]:
    reports: list[PartitionReport] = []
    fw, bw = SaveAllPartitioner(on_report=reports.append)(gm, [], num_fwd_outputs=1)
    return fw, bw, reports[0]


def saved(fw: fx.GraphModule) -> list[str]:
    out = fw.graph.find_nodes(op="output")[0]
    return [n.name for n in out.args[0][1:] if isinstance(n, fx.Node)]


def _with_dead_node(simple: Simple) -> fx.GraphModule:
    """``simple`` with ``add_tensor`` replayed, plus an unused ``dead_cos`` tagged as saved
    (DCE removes it, so skipping DCE would save it)."""
    gm = simple(ap_tags.mark_must_save)
    x = next(iter(gm.graph.find_nodes(op="placeholder")))
    add = next(n for n in gm.graph.nodes if n.name == "add_tensor")
    with gm.graph.inserting_after(add):
        dead = gm.graph.call_function(aten.cos.default, (x,))
    dead.name = "dead_cos"
    dead.meta["val"] = torch.cos(x.meta["val"])
    ap_tags.mark_must_save(dead)
    gm.recompile()
    return gm


def _state(gm: fx.GraphModule) -> tuple[str, list[dict[str, object]]]:
    return gm.graph.python_code("self").src, [dict(n.meta) for n in gm.graph.nodes]


def test_dce_noop_check(simple: Simple) -> None:
    assert dce_would_remove_nothing(simple().graph)
    assert not dce_would_remove_nothing(_with_dead_node(simple).graph)
    gm = simple()
    gm.add_submodule("sub", torch.nn.Module())
    first = next(iter(gm.graph.nodes))
    with gm.graph.inserting_after(first):
        gm.graph.get_attr("sub")  # a get_attr may own a subgraph DCE would recurse into
    assert not dce_would_remove_nothing(gm.graph)


def test_normalized_copy_is_a_new_graph_and_leaves_metas_alone(simple: Simple) -> None:
    gm = simple(ap_tags.mark_must_save)
    before = _state(gm)
    out = normalized_copy(gm)
    assert out is not gm and out.graph is not gm.graph
    assert not set(out.graph.nodes) & set(gm.graph.nodes)
    assert _state(gm) == before


def test_no_cse_identical_forward_and_backward_values_stay_apart(joint: Any) -> None:
    """The backward recomputes ``sin(x)`` as the first partition decided; CSE would merge it
    into the forward's identical ``sin`` and make the backward read that instead."""
    j = joint()
    x = j.input("primals_1", 4)
    t = j.input("tangents_1", 4)
    fwd = j.op(aten.sin.default, x, name="sin_fwd")
    out = j.op(aten.mul.Tensor, fwd, fwd, name="out")
    again = j.op(aten.sin.default, x, name="sin_bwd")
    again.meta["autograd_backward"] = True
    grad = j.op(aten.mul.Tensor, again, t, name="grad")
    grad.meta["autograd_backward"] = True
    gm = j.module(out, grad)
    names = {n.name for n in normalized_copy(gm).graph.nodes}
    assert {"sin_fwd", "sin_bwd"} <= names


def test_dead_code_path_copies_and_both_paths_partition_alike(simple: Simple) -> None:
    gm = _with_dead_node(simple)
    before = _state(gm)
    fw, bw, rep = partition(gm)
    assert not rep.fell_back
    assert _state(gm) == before  # the dead node is still in the caller's graph
    assert "dead_cos" not in {n.name for n in fw.graph.nodes}
    fw2, bw2, _ = partition(simple(ap_tags.mark_must_save))
    assert saved(fw) == saved(fw2) == ["add_tensor"]
    assert bw.code == bw2.code


def test_gc_state_restored_after_calls_and_refusals(simple: Simple) -> None:
    assert gc.isenabled()
    partition(simple(ap_tags.mark_must_save))
    assert gc.isenabled()
    gc.disable()
    try:
        partition(simple(ap_tags.mark_must_save))
        assert not gc.isenabled()  # a caller's disabled GC stays disabled
    finally:
        gc.enable()


def test_partitioning_runs_with_the_cyclic_gc_paused(
    simple: Simple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generation-2 sweeps over a heap of large joint graphs made partitioning quadratic: the
    replay (prologue, planning, extraction) runs with the collector off."""
    seen: list[bool] = []

    def spy(name: str) -> Callable[..., Any]:
        real = getattr(torch_partitioners, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            seen.append(gc.isenabled())
            return real(*args, **kwargs)

        return wrapper

    for name in ("classify_nodes", "_extract_fwd_bwd_modules"):
        monkeypatch.setattr(torch_partitioners, name, spy(name))
    partition(simple(ap_tags.mark_must_save))
    assert seen == [False, False]
    assert gc.isenabled()
