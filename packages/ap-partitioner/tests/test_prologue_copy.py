"""The replay's copy strategy and GC pause: cheaper, with the caller's graph still untouched.

The prologue skips the node-by-node working copy when DCE provably has nothing to remove (CSE
already builds a new graph); with dead code it copies first. Both paths must give the same
partition and leave the caller's graph (nodes and metas) exactly as it was.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import Any

import ap_tags
import torch
import torch.fx as fx
from ap_partitioner import PartitionReport, SaveAllPartitioner, _gcpause
from ap_partitioner._prologue import dce_would_remove_nothing, normalized_copy

aten = torch.ops.aten


class Joint:
    """A tiny joint-graph builder: nodes carry real CPU values as ``meta["val"]``."""

    def __init__(self) -> None:
        self.g = fx.Graph()

    def input(self, name: str, *shape: int) -> fx.Node:
        node = self.g.placeholder(name)
        node.meta["val"] = torch.randn(*shape)
        return node

    def op(self, target: Callable[..., Any], *args: fx.Node, name: str) -> fx.Node:
        node = self.g.call_function(target, args)
        node.name = name
        node.meta["val"] = target(*[a.meta["val"] for a in args])
        return node

    def module(self, *outputs: fx.Node) -> fx.GraphModule:
        out = self.g.output(tuple(outputs))
        out.meta["desc"] = [None] * len(outputs)
        return fx.GraphModule(torch.nn.Module(), self.g)


def tag(node: fx.Node, *, replay: bool = False) -> None:
    if replay:
        node.meta.setdefault("custom", {})[ap_tags.MUST_SAVE] = True


def partition(gm: fx.GraphModule) -> tuple[fx.GraphModule, fx.GraphModule, PartitionReport]:
    reports: list[PartitionReport] = []
    fw, bw = SaveAllPartitioner(on_report=reports.append)(gm, [], num_fwd_outputs=1)
    return fw, bw, reports[0]


def saved(fw: fx.GraphModule) -> list[str]:
    out = fw.graph.find_nodes(op="output")[0]
    return [n.name for n in out.args[0][1:] if isinstance(n, fx.Node)]


def simple(meta_tagger: Callable[[fx.Node], None]) -> fx.GraphModule:
    """fwd: add = x + x (user output); bwd: mul(sin(add), tangent)."""
    j = Joint()
    x = j.input("primals_1", 4)
    t = j.input("tangents_1", 4)
    add = j.op(aten.add.Tensor, x, x, name="add_tensor")
    meta_tagger(add)
    sin = j.op(aten.sin.default, add, name="sin")
    grad = j.op(aten.mul.Tensor, sin, t, name="mul")
    return j.module(add, grad)


def _with_dead_node() -> fx.GraphModule:
    j = Joint()
    x = j.input("primals_1", 4)
    t = j.input("tangents_1", 4)
    add = j.op(aten.add.Tensor, x, x, name="add_tensor")
    tag(add, replay=True)
    dead = j.op(aten.cos.default, x, name="dead_cos")  # no users: DCE removes it
    tag(dead, replay=True)  # so skipping DCE would save it
    sin = j.op(aten.sin.default, add, name="sin")
    grad = j.op(aten.mul.Tensor, sin, t, name="mul")
    return j.module(add, grad)


def _state(gm: fx.GraphModule) -> tuple[str, list[dict[str, object]]]:
    return gm.graph.python_code("self").src, [dict(n.meta) for n in gm.graph.nodes]


def test_dce_noop_check() -> None:
    assert dce_would_remove_nothing(simple(lambda n: None).graph)
    assert not dce_would_remove_nothing(_with_dead_node().graph)
    gm = simple(lambda n: None)
    gm.add_submodule("sub", torch.nn.Module())
    first = next(iter(gm.graph.nodes))
    with gm.graph.inserting_after(first):
        gm.graph.get_attr("sub")  # a get_attr may own a subgraph DCE would recurse into
    assert not dce_would_remove_nothing(gm.graph)


def test_copy_free_path_returns_a_new_graph_and_leaves_metas_alone() -> None:
    gm = simple(lambda n: tag(n, replay=True))
    before = _state(gm)
    out = normalized_copy(gm, 1)
    assert out is not gm and out.graph is not gm.graph
    assert not set(out.graph.nodes) & set(gm.graph.nodes)
    assert _state(gm) == before  # CSE's mutation_region_id stamp was put back


def test_dead_code_path_copies_and_both_paths_partition_alike() -> None:
    gm = _with_dead_node()
    before = _state(gm)
    fw, bw, rep = partition(gm)
    assert not rep.fell_back
    assert _state(gm) == before  # the dead node is still in the caller's graph
    assert "dead_cos" not in {n.name for n in fw.graph.nodes}
    fw2, bw2, _ = partition(simple(lambda n: tag(n, replay=True)))
    assert saved(fw) == saved(fw2) == ["add_tensor"]
    assert bw.code == bw2.code


def test_gc_state_restored_after_calls_and_refusals() -> None:
    assert gc.isenabled()
    partition(simple(lambda n: tag(n, replay=True)))
    assert gc.isenabled()
    gc.disable()
    try:
        partition(simple(lambda n: tag(n, replay=True)))
        assert not gc.isenabled()  # a caller's disabled GC stays disabled
    finally:
        gc.enable()


def test_gc_pause_nests_across_threads() -> None:
    inside: list[bool] = []
    gate = threading.Barrier(4)

    def work() -> None:
        with _gcpause.paused_gc():
            gate.wait()
            inside.append(gc.isenabled())
            gate.wait()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert inside == [False] * 4
    assert gc.isenabled()
