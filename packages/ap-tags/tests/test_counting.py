"""``ap_tags.counting.count_saved``: tensors, storages (views of one base share it, by op schema
aliasing, through multi-output view ops too), bytes per storage, symbols; inputs excluded."""

from __future__ import annotations

import operator

import torch
import torch.fx
from ap_tags.counting import count_saved, count_saved_values

aten = torch.ops.aten


def _node(
    g: torch.fx.Graph, target: object, *args: object, val: object, name: str
) -> torch.fx.Node:
    n = g.call_function(target, args)  # type: ignore[arg-type]
    n.name = name
    n.meta["val"] = val
    return n


def test_views_share_a_storage_inputs_and_symbols_are_apart() -> None:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, 8)
    relu = _node(g, aten.relu.default, x, val=torch.empty(4, 8), name="relu")
    view = _node(g, aten.view.default, relu, [32], val=torch.empty(32), name="view")
    det = _node(g, aten.detach.default, view, val=torch.empty(32), name="detach")
    t = _node(g, aten.t.default, x, val=torch.empty(8, 4), name="t")
    mm = _node(g, aten.mm.default, relu, t, val=torch.empty(4, 4, dtype=torch.float64), name="mm")
    split = _node(
        g, aten.split.Tensor, mm, 2, val=(torch.empty(2, 4), torch.empty(2, 4)), name="split"
    )
    part = _node(
        g, operator.getitem, split, 1, val=torch.empty(2, 4, dtype=torch.float64), name="getitem"
    )
    sym = _node(g, aten.sym_size.int, x, 0, val=4, name="sym_size_int")
    loss = _node(g, aten.sum.default, relu, val=torch.empty(()), name="sum")
    g.output((loss, relu, view, det, t, part, sym))
    counted = count_saved(torch.fx.GraphModule(torch.nn.Module(), g), 1)
    assert counted.tensors == ("relu", "view", "detach", "getitem")
    assert counted.storages == ("relu", "mm")
    assert counted.bytes_by_storage() == {"relu": 128, "mm": 128}
    assert counted.storage_keys == (("torch.float32", 128), ("torch.float64", 128))
    assert counted.inputs == ("t",) and counted.symbols == ("sym_size_int",)
    assert (counted.tensor_count, counted.storage_count, counted.nbytes) == (4, 2, 256)


def test_nothing_saved() -> None:
    counted = count_saved_values([])
    assert (counted.tensor_count, counted.storage_count, counted.nbytes) == (0, 0, 0)
