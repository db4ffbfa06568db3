"""A chunk plan whose bodies bind unbacked symbols (``.tolist()`` split sizes) on a joint graph
AOTAutograd traced from Dynamo without ``precompile`` (issue 34, item 2): chunked when the
token dim is a hinted unbacked symbol, refused at compile time with static token sizes (the
graph's runtime asserts carry the full batch's count); accepted from ``trace_joint`` or a
precompiled module's second compilation either way. And each chunk's copy of a data-dependent
op binds a symbol of its own also where AOTAutograd's retrace renamed the binding
(``unbacked_bindings`` keyed by ``u26``, the value mentioning ``u1``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ap_epchunk import ChunkConfig, ChunkError, chunk_pass
from ap_epchunk._errors import BACKWARD_FQN_KEY
from ap_testing.graphs import snapshot

desc = pytest.importorskip("torch._functorch._aot_autograd.descriptors")
aten = torch.ops.aten
CFG = ChunkConfig(module_patterns=("layers.*",))
STATIC = ChunkConfig(module_patterns=("layers.*",), chunk_inputs=("x",))


def _graph(
    fake_graph: Any, *, described: bool, stamped: bool, static: bool = False, renamed: bool = False
) -> torch.fx.GraphModule:
    """``layers.0``: ``n = x.sum().item()`` and ``relu(x) + n``; a backward op outside it.
    ``static``: ``x`` is ``[8, 4]`` (else ``[u0, 4]``, u0 hinted 8); ``renamed``: the
    ``.item()`` binding is keyed by a raw symbol the ShapeEnv renamed to ``n``'s, as after
    AOTAutograd's retrace of a Dynamo graph."""
    b = fake_graph()
    u0 = 8 if static else b.unbacked(8)
    x = b.placeholder("x", b.fake(u0, 4))
    if described:
        x.meta["desc"] = desc.PlainAOTInput(0)
    s = b.op(aten.sum.default, x, fqn="layers.0")
    item = b.graph.call_function(aten._local_scalar_dense.default, (s,))
    n = b.unbacked(3)
    key = n.node.expr
    if renamed:
        key = b.unbacked(None).node.expr
        b.shape_env.unbacked_renamings[key] = n.node.expr
    item.meta.update(val=n, unbacked_bindings={key: ()}, custom={"module_fqn": "layers.0"})
    r = b.op(aten.relu.default, x, fqn="layers.0")
    out = b.op(aten.add.Tensor, r, item, fqn="layers.0")
    bw = b.op(aten.neg.default, out, fqn="head", backward=True)
    if stamped:
        bw.meta["custom"] = {**bw.meta["custom"], BACKWARD_FQN_KEY: "head"}
    return b.module(out, bw)


def test_static_dynamo_graph_without_first_compilation_is_refused_untouched(
    fake_graph: Any,
) -> None:
    gm = _graph(fake_graph, described=True, stamped=False, static=True)
    before = snapshot(gm)
    with pytest.raises(ChunkError) as e:
        chunk_pass(gm, STATIC)
    msg = str(e.value)
    assert msg.startswith("node '_local_scalar_dense_default': data-dependent op in chunked")
    assert "with static token sizes" in msg
    assert "ap_backend.precompile(module, example_args)" in msg
    assert "mark_chunk_dim(t, 0, hint=t.shape[0])" in msg
    assert snapshot(gm) == before


@pytest.mark.parametrize(
    ("described", "stamped", "static"),
    [
        (False, False, False),
        (False, False, True),
        (True, True, False),
        (True, True, True),
        (True, False, False),
    ],
    ids=["trace_joint", "trace_joint-static", "precompiled", "precompiled-static", "dynamo-hinted"],
)
def test_graphs_that_are_chunked(
    fake_graph: Any, described: bool, stamped: bool, static: bool
) -> None:
    gm = _graph(fake_graph, described=described, stamped=stamped, static=static)
    report = chunk_pass(gm, STATIC if static else CFG)
    assert report.regions[0].root == "layers.0" and report.concatenated == ["add_tensor"]


def _item_copies(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target is aten._local_scalar_dense.default]


@pytest.mark.parametrize("renamed", [False, True], ids=["make_fx", "aot-renamed"])
def test_each_chunk_binds_its_own_symbol(fake_graph: Any, renamed: bool) -> None:
    """Every chunk's ``.item()`` copy binds a fresh symbol (not the traced ``n``, whose facts
    are the full batch's), its value and its binding name the same symbol, and the chunk's
    ``add`` reads it. Before the binding keys were resolved through the ShapeEnv's renamings,
    a renamed graph's copies all kept ``n`` (torchtitan's Qwen3-MoE through torch.compile:
    one chunk's split sizes read for another's, 'allocated size does not match required
    size')."""
    gm = _graph(fake_graph, described=True, stamped=False, renamed=renamed)
    traced = _item_copies(gm)[0].meta["val"].node.expr
    chunk_pass(gm, CFG)
    items = _item_copies(gm)
    assert len(items) == 2
    syms = [n.meta["val"].node.expr for n in items]
    assert len(set(syms)) == 2 and traced not in syms
    for node, sym in zip(items, syms, strict=True):
        assert list(node.meta["unbacked_bindings"]) == [sym]
        (add,) = [u for u in node.users if u.target is aten.add.Tensor]
        index = node.meta["custom"]["ap_chunk_index"]
        assert add.meta["custom"]["ap_chunk_index"] == index
