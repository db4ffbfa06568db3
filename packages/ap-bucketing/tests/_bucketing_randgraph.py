"""Random collective graphs for ap-bucketing's graph-safety properties (hypothesis).

Small DAGs of pointwise ops, matmuls, views, a multi-output op (``split`` -> getitems) and
functional collectives (all-gather / reduce-scatter / all-reduce on two groups, waits issued
late and out of order), with random node tags (which bucketing must ignore) and, optionally, a
collective whose ``meta["val"]`` is missing (which bucketing must refuse without touching the
graph). Values are CPU fake tensors because torch's bucket merging traces through fake mode.
The module name is package-specific: every package's tests may run in one pytest process.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from ap_bucketing.synthetic import GraphBuilder
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import CheckpointPolicy

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
ROWS = 8


@dataclass
class RandomCollectiveGraph:
    gm: fx.GraphModule
    all_gathers: int
    reduce_scatters: int
    missing_val: str | None


@st.composite
def random_collective_graphs(draw: st.DrawFn, groups: tuple[str, ...]) -> RandomCollectiveGraph:
    b = GraphBuilder(dtype=torch.float32)
    ready: list[fx.Node] = [b.placeholder((ROWS, ROWS))]
    pending: list[fx.Node] = []
    n_ag = n_rs = 0
    for _ in range(draw(st.integers(2, 16))):
        action = draw(
            st.sampled_from(
                ["ph", "pointwise", "mm", "view", "split", "ag", "ag", "rs", "ar", "wait"]
            )
        )
        if action == "ph":
            ready.append(b.placeholder((ROWS, ROWS)))
        elif action == "pointwise":
            x, y = draw(st.sampled_from(ready)), draw(st.sampled_from(ready))
            ready.append(b.add(x, y) if draw(st.booleans()) else b.relu(x))
        elif action == "mm":
            ready.append(b.mm(draw(st.sampled_from(ready)), draw(st.sampled_from(ready))))
        elif action == "view":
            x = draw(st.sampled_from(ready))
            ready.append(b.call(aten.t.default, (x,), (ROWS, ROWS)))
        elif action == "split":
            x = draw(st.sampled_from(ready))
            parent = b.call(aten.split.Tensor, (x, ROWS // 2), (ROWS, ROWS))
            parent.meta["val"] = (torch.empty(ROWS // 2, ROWS, device="meta"),) * 2
            halves = [b.call(operator.getitem, (parent, i), (ROWS // 2, ROWS)) for i in range(2)]
            ready.append(b.call(aten.cat.default, (halves,), (ROWS, ROWS)))
        elif action in ("ag", "rs", "ar"):
            src = draw(st.sampled_from(ready))
            group = draw(st.sampled_from(groups))
            if action == "ag":
                if draw(st.booleans()):  # an FSDP-style gather of a parameter shard
                    shard = b.placeholder((ROWS // 2, ROWS))
                else:
                    shard = b.call(aten.slice.Tensor, (src, 0, 0, ROWS // 2), (ROWS // 2, ROWS))
                coll = b.all_gather(shard, group=group, group_size=2)[0]
                n_ag += 1
            elif action == "rs":
                coll = b.reduce_scatter(src, group=group, group_size=2)[0]
                n_rs += 1
            else:
                coll = b.all_reduce(src, group=group)[0]
            b.graph.erase_node(next(iter(coll.users)))  # its wait comes later
            pending.append(coll)
        elif pending:
            ready.append(_wait(b, pending.pop(draw(st.integers(0, len(pending) - 1)))))
    while pending:
        ready.append(_wait(b, pending.pop(draw(st.integers(0, len(pending) - 1)))))
    gm = b.module(ready[-draw(st.integers(1, 3)) :])
    _fakeify(gm)
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    for n in draw(st.lists(st.sampled_from(nodes), max_size=4, unique=True)):
        n.meta["custom"] = {"ap_must_save": draw(st.booleans()), "module_fqn": "layers.0"}
        n.meta["recompute"] = draw(st.sampled_from(list(CheckpointPolicy)))
    missing = None
    colls = [
        n
        for n in nodes
        if str(n.target).startswith("_c10d_functional.") and "wait" not in str(n.target)
    ]
    if colls and draw(st.integers(0, 7)) == 0:
        victim = draw(st.sampled_from(colls))
        del victim.meta["val"]
        missing = victim.name
    return RandomCollectiveGraph(gm, n_ag, n_rs, missing)


def _wait(b: GraphBuilder, coll: fx.Node) -> fx.Node:
    """The wait, brought back to ``(ROWS, ROWS)`` (a reduce-scatter halves the rows)."""
    w = b.graph.call_function(c10d.wait_tensor.default, (coll,))
    w.meta["val"] = coll.meta["val"]
    if tuple(w.meta["val"].shape) != (ROWS, ROWS):
        w = b.call(aten.cat.default, ([w, w],), (ROWS, ROWS))
    return w


def _fakeify(gm: fx.GraphModule) -> None:
    mode = FakeTensorMode()

    def fake(val: Any) -> Any:
        if isinstance(val, torch.Tensor):
            return mode.from_tensor(torch.empty(val.shape, dtype=val.dtype))
        if isinstance(val, tuple):
            return tuple(fake(v) for v in val)
        return val

    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["val"] = fake(node.meta["val"])


def _meta_form(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_meta_form(v) for v in value))
    if isinstance(value, dict):
        return {k: _meta_form(v) for k, v in value.items()}
    return copy.deepcopy(value)


def snapshot(gm: fx.GraphModule) -> tuple[str, list[tuple[str, Any]]]:
    return gm.graph.python_code("self").src, [
        (n.name, _meta_form(dict(n.meta))) for n in gm.graph.nodes
    ]
