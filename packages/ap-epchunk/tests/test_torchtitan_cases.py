"""The two chunk-pass cases of torchtitan's own ``ep_chunk_pass`` tests that ap-epchunk used to
refuse or leave symbolic (issue 34, item 4), written for ap-epchunk:

* a view whose size is computed in the body from data-dependent scalars
  (``view(x, [u1 + u2, -1])``), guarded by a runtime assert traced outside every module
  (``_assert_scalar(u1 + u2 == x.size(0))``): the guard joins the region and is checked once
  per chunk, on that chunk's scalars;
* ``concretize_chunk_symbols`` replaces chunk symbols in ``meta["example_value"]`` (and
  ``meta["val"]``) of placeholders, scalar or tensor, also inside a subgraph passed as a node
  argument, with or without ``chunk_pass``'s record of the chunk symbols.
"""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
from ap_epchunk import ChunkConfig, ChunkError, chunk_pass, concretize_chunk_symbols
from ap_epchunk._passes import CHUNK_SYMBOLS_META
from ap_testing.graphs import snapshot
from torch.fx.experimental.symbolic_shapes import free_symbols

aten = torch.ops.aten
FQN = {"module_fqn": "layers.0"}


def _scalar(b: Any, src: torch.fx.Node, hint: int) -> tuple[torch.fx.Node, torch.SymInt]:
    """``src.item()``: a data-dependent scalar bound to a fresh hinted unbacked symbol."""
    node = b.graph.call_function(aten._local_scalar_dense.default, (src,))
    val = b.unbacked(hint)
    node.meta.update(val=val, unbacked_bindings={val.node.expr: ()}, custom=dict(FQN))
    return node, val


def _baked_view_graph(
    fake_graph: Any, guard_fqn: str | None = None
) -> tuple[torch.fx.GraphModule, Any]:
    """torchtitan's ``test_chunk_batch_freshens_body_local_unbacked_bindings`` graph: x [u0, 3]
    (int64, hint 4); in ``layers.0``: two ``x.sum().item()`` scalars, their sum, the guard
    ``sum == x.size(0)`` and ``view(x, [sum, -1])``. The guard has no module unless
    ``guard_fqn``."""
    b = fake_graph()
    u0 = b.unbacked(4)
    with b.fake_mode:
        xv = torch.empty(u0, 3, dtype=torch.int64)
    x = b.placeholder("x", xv)
    s1 = b.op(aten.sum.default, x, fqn="layers.0")
    a, av = _scalar(b, s1, 2)
    s2 = b.op(aten.sum.default, x, fqn="layers.0")
    c, cv = _scalar(b, s2, 2)
    with b.fake_mode:
        torch._check(av <= u0)
        torch._check(cv <= u0)
    size = b.op(aten.sym_size.int, x, 0, fqn="layers.0")
    total = b.op(operator.add, a, c, fqn="layers.0")
    eq = b.op(operator.eq, total, size)  # traced outside every module, like the guard
    guard = b.graph.call_function(aten._assert_scalar.default, (eq, "splits cover the tokens"))
    guard.meta["val"] = None
    if guard_fqn is not None:
        for node in (eq, guard):
            node.meta["custom"] = {"module_fqn": guard_fqn}
    view = b.graph.call_function(aten.view.default, (x, [total, -1]))
    view.meta.update(val=xv, custom=dict(FQN))  # the assert made u1 + u2 == u0
    return b.module(view), (u0, av, cv)


def _calls(gm: torch.fx.GraphModule, target: Any) -> list[torch.fx.Node]:
    return list(gm.graph.find_nodes(op="call_function", target=target))


def test_a_view_sized_by_body_scalars_is_chunked_and_its_guard_checked_per_chunk(
    fake_graph: Any,
) -> None:
    gm, (u0, av, cv) = _baked_view_graph(fake_graph)
    report = chunk_pass(gm, ChunkConfig(("layers.*",), num_chunks=2))
    assert report.concatenated == ["view_default"]
    items = _calls(gm, aten._local_scalar_dense.default)
    fresh = {next(iter(n.meta["unbacked_bindings"])) for n in items}
    assert len(items) == 4 and len(fresh) == 4  # one fresh symbol per scalar per chunk
    assert not fresh & {av.node.expr, cv.node.expr}
    views = _calls(gm, aten.view.default)
    assert len(views) == 2
    for chunk, view in enumerate(views):
        (total,) = [a for a in view.args[1] if isinstance(a, torch.fx.Node)]
        assert free_symbols(total.meta["val"]) <= fresh  # the chunk's own scalars
        assert str(view.meta["val"].shape[0]) == f"(({u0}//2))".strip("()").join("()")
        assert view.meta["custom"]["ap_chunk_index"] == chunk
    guards = _calls(gm, aten._assert_scalar.default)
    assert len(guards) == 2  # the guard is checked once per chunk
    for guard in guards:
        cond = guard.args[0].meta["val"]
        assert str(cond).endswith(f"({u0}//2))"), cond  # chunk-local sum == chunk extent
    concretize_chunk_symbols(gm)
    x = torch.zeros(4, 3, dtype=torch.int64)
    x[0, 0] = x[2, 0] = 1  # each chunk: item() + item() == 1 + 1 == 2 rows
    assert torch.equal(gm(x)[0], x)
    x[2, 0], x[1, 0] = 0, 1  # the full tensor still sums to 2 + 2 == 4, chunk 1 to 0
    with pytest.raises(RuntimeError, match="splits cover the tokens"):
        gm(x)


def test_the_guard_is_the_same_as_one_traced_inside_the_module(fake_graph: Any) -> None:
    outside, _ = _baked_view_graph(fake_graph)
    inside, _ = _baked_view_graph(fake_graph, guard_fqn="layers.0")
    chunk_pass(outside, ChunkConfig(("layers.*",), num_chunks=2))
    chunk_pass(inside, ChunkConfig(("layers.*",), num_chunks=2))
    assert outside.code == inside.code


def test_a_guard_over_two_regions_stays_outside_and_the_pass_refuses_untouched(
    fake_graph: Any,
) -> None:
    gm, _ = _baked_view_graph(fake_graph)
    eq = next(iter(gm.graph.find_nodes(op="call_function", target=operator.eq)))
    size = eq.args[1]
    size.meta["custom"] = {"module_fqn": "layers.1"}  # the guard now reads two regions
    before = snapshot(gm)
    with pytest.raises(ChunkError, match=r"'add'.*escapes to full users \(eq\)"):
        chunk_pass(gm, ChunkConfig(("layers.*",), num_chunks=2))
    assert snapshot(gm) == before


def _call_with_subgraph(sub: torch.fx.GraphModule, value: Any) -> Any:
    return value


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "unrecorded"])
@pytest.mark.parametrize("key", ["example_value", "val"])
@pytest.mark.parametrize("kind", ["scalar", "tensor"])
def test_concretize_replaces_meta_values_in_a_subgraph_passed_as_an_argument(
    fake_graph: Any, kind: str, key: str, recorded: bool
) -> None:
    """torchtitan's ``test_concretize_chunk_symbols_updates_nested_graph_modules`` /
    ``..._nested_scalar_example_values``: a HOP-style subgraph handed to a node as an
    argument (no ``get_attr``), its placeholder carrying the chunk symbol."""
    b = fake_graph()
    u0 = b.unbacked(4)
    value = u0 if kind == "scalar" else b.fake(u0, 3)
    sub_graph = torch.fx.Graph()
    inner = sub_graph.placeholder("inner")
    inner.meta[key] = value
    sub_graph.output(inner)
    sub = torch.fx.GraphModule(torch.nn.Module(), sub_graph)
    graph = torch.fx.Graph()
    outer = graph.placeholder("outer")
    outer.meta[key] = value
    call = graph.call_function(_call_with_subgraph, (sub, outer))
    call.meta[key] = value
    graph.output(call)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    if recorded:
        gm.meta[CHUNK_SYMBOLS_META] = {str(u0): 4}
    report = concretize_chunk_symbols(gm)
    assert report.symbols == {str(u0): 4} and report.graphs == 2
    for node in (outer, call, inner):
        got = node.meta[key]
        if kind == "scalar":
            assert got == 4 and type(got) is int, (node, got)
        else:
            assert tuple(got.shape) == (4, 3), (node, got)
