"""ap_tags.graph: the one definition of each concept the passes share.

Hand-built graphs with the exact node shapes real joint graphs have (functional collectives,
``wait_tensors`` + getitem on 2.15, views and ``_unsafe_view``), plus a traced joint for the
direction predicates.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx
from ap_tags import graph as G
from ap_testing.graphs import Builder
from torch.fx.experimental.symbolic_shapes import ShapeEnv

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _chain() -> tuple[torch.fx.GraphModule, dict[str, torch.fx.Node]]:
    """shard -> all_gather -> wait -> _unsafe_view / t / clone; plus a reduce-scatter."""
    b = Builder()
    shard = b.ph("primals_1", (4, 8))
    ag = b.all_gather(shard)
    wait = b.wait(ag)
    uview = b.op(aten._unsafe_view.default, (wait, [16, 8]), "uview", (16, 8))
    t = b.op(aten.t.default, (uview,), "t", (8, 16))
    clone = b.op(aten.clone.default, (t,), "clone", (8, 16))
    reshape = b.op(aten.reshape.default, (wait, [128]), "reshape", (128,))
    rs = b.op(c10d.reduce_scatter_tensor.default, (clone, "sum", 4, "0"), "rs", (2, 16))
    rs_wait = b.op(c10d.wait_tensor.default, (rs,), "rs_wait", (2, 16))
    gm = b.done(t, clone, reshape, rs_wait)
    return gm, {n.name: n for n in gm.graph.nodes}


def test_collective_kinds() -> None:
    _, n = _chain()
    assert G.is_all_gather(n["ag"]) and G.is_collective(n["ag"]) and not G.is_wait(n["ag"])
    assert G.is_wait(n["wait"]) and not G.is_collective(n["wait"])
    assert G.is_reduce_scatter(n["rs"]) and G.is_collective(n["rs"])
    assert not G.is_all_gather(n["rs"]) and not G.is_reduce_scatter(n["ag"])
    for name in ("primals_1", "uview", "t", "clone", "output"):
        node = n[name]
        assert not (G.is_wait(node) or G.is_collective(node) or G.is_all_gather(node))
    assert G.collective_input(n["wait"]) is n["ag"]


def test_storage_follows_aliases_only() -> None:
    _, n = _chain()
    assert G.aliases_input(n["uview"]) and G.aliases_input(n["t"])
    assert G.aliases_input(n["reshape"])  # its schema says it may alias
    assert not G.aliases_input(n["clone"])
    assert G.storage_base(n["t"]) is n["wait"]
    assert G.storage_base(n["clone"]) is n["clone"]
    assert G.storage_base(n["primals_1"]) is n["primals_1"]


def test_all_gather_output_is_storage_of_a_gather() -> None:
    """The case the two former definitions disagreed on: ``_unsafe_view(wait(ag))``."""
    _, n = _chain()
    for name in ("ag", "wait", "uview", "t", "reshape"):
        assert G.is_all_gather_output(n[name]), name
    for name in ("primals_1", "clone", "rs", "rs_wait"):
        assert not G.is_all_gather_output(n[name]), name


def test_all_gather_output_through_wait_tensors_getitem() -> None:
    """2.15's ``wait_tensors([ag_a, ag_b]) -> getitem(i)``: output i is gather i's buffer."""
    if not hasattr(c10d, "wait_tensors"):
        pytest.skip("wait_tensors is new in torch 2.15")
    b = Builder()
    x = b.ph("x", (16, 8))
    ag = b.all_gather(b.ph("primals_1"))
    ar = b.op(c10d.all_reduce.default, (x, "sum", "0"), "ar", (16, 8))
    waits = b.op(c10d.wait_tensors.default, ([ar, ag],), "waits", (16, 8))
    waits.meta["val"] = (torch.empty(16, 8), torch.empty(16, 8))
    reduced = b.op(operator.getitem, (waits, 0), "reduced", (16, 8))
    gathered = b.op(operator.getitem, (waits, 1), "gathered", (16, 8))
    view = b.op(aten.view.default, (gathered, [128]), "view", (128,))
    b.done(reduced, view)
    assert G.is_wait(waits) and G.is_multi_output(waits)
    assert G.is_all_gather_output(gathered) and G.is_all_gather_output(view)
    assert not G.is_all_gather_output(reduced)
    assert G.storage_base(view) is gathered  # a getitem is its own storage


def test_all_gather_output_refuses_non_nodes() -> None:
    with pytest.raises(TypeError, match="is_all_gather_output: node must be a torch.fx.Node"):
        G.is_all_gather_output("wait")  # type: ignore[arg-type]


def test_backward_direction() -> None:
    b = Builder()
    x = b.ph("primals_1")
    tangent = b.ph("tangents_1")
    fwd = b.op(aten.relu.default, (x,), "fwd")
    marked = b.op(aten.mul.Tensor, (fwd, fwd), "marked")
    marked.meta["autograd_backward"] = True
    tagged = b.op(aten.neg.default, (fwd,), "tagged")
    tagged.meta["partitioner_tag"] = "must_be_in_backward"
    unmarked = b.op(aten.add.Tensor, (tangent, fwd), "unmarked")  # reads a tangent
    shared_seq = b.op(aten.sin.default, (fwd,), "shared_seq")
    shared_seq.meta["seq_nr"] = fwd.meta["seq_nr"] = 7  # same seq_nr, still forward
    gm = b.done(marked, tagged, unmarked, shared_seq)
    n = {node.name: node for node in gm.graph.nodes}
    assert G.is_tangent(tangent) and not G.is_tangent(x)
    assert G.is_backward_node(marked) and G.is_backward_node(tagged)
    assert not G.is_backward_node(unmarked) and not G.is_backward_node(shared_seq)
    assert G.backward_nodes(gm) == {n["tangents_1"], n["marked"], n["tagged"], n["unmarked"]}


def test_size_hint_backed_hinted_and_unknown() -> None:
    env = ShapeEnv()
    hinted = env.create_unbacked_symint()
    env.var_to_hint_override[hinted.node.expr] = 12
    unknown = env.create_unbacked_symint()
    assert G.size_hint(5) == 5
    assert G.size_hint(hinted) == 12 and G.size_hint(hinted // 2 + 3) == 9
    # torch's optimization_hint would invent 8192 here; an unhinted size is unknown
    assert G.size_hint(unknown) is None and G.size_hint(unknown * 2) is None
    with pytest.raises(TypeError, match="bool"):
        G.size_hint(True)


def test_bytes_from_hints_and_storage_counted_once() -> None:
    gm, n = _chain()
    assert G.node_nbytes(n["wait"]) == 16 * 8 * 4
    assert G.node_nbytes(n["output"]) == 0
    # wait, its _unsafe_view and its transpose are one storage
    assert G.storage_nbytes([n["wait"], n["uview"], n["t"]]) == 16 * 8 * 4
    assert G.storage_nbytes([n["t"], n["clone"]]) == 2 * 16 * 8 * 4
    assert G.tensor_nbytes("not a tensor") == 0
    env = ShapeEnv()
    u = env.create_unbacked_symint()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(shape_env=env):
        fake = torch.empty(u, 4)
    assert G.tensor_nbytes(fake) is None  # unknown, never guessed
    env.var_to_hint_override[u.node.expr] = 3
    assert G.tensor_nbytes(fake) == 3 * 4 * 4
