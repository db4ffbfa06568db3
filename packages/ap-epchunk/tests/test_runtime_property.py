"""Every graph ``chunk_pass`` accepts must run, and compute what chunking means.

Random region graphs (hypothesis) are built node by node, with the patterns real MoE code
produces and a structure-only check misses: raw SymInt size arguments (``as_strided(x, [u0,
D], ...)``, ``full([u0, D])``, ``arange(u0)``), sizes baked as constants (``view(x, [8, D])``),
creation ops (``zeros_like`` + ``scatter_add``), a buffer updated through ``add`` + ``copy_``,
and a data-dependent scalar (``.item()``). Each graph is built twice, in symbolic mode (a
hinted unbacked token extent) or in static mode (plain ints + ``chunk_inputs``).

Accepted graphs are concretized and **executed** -- eagerly and through ``torch.compile``
(``aot_eager``: AOTAutograd re-traces and checks every node's sizes) -- and must equal the
reference: the same recipe built at the chunk's size and run chunk after chunk (what
``EagerChunked`` does; the buffer sees the chunks in order). Recipes without token mixing must
also equal the unchunked graph. A graph that is accepted and fails to run fails the test. A
refusal must leave the graph exactly as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from ap_epchunk import ChunkConfig, ChunkError, chunk_pass, concretize_chunk_symbols
from ap_testing.chunking import property_settings
from ap_testing.graphs import snapshot
from hypothesis import given
from hypothesis import strategies as st

aten = torch.ops.aten
D = 4
REGION = "layers.0"

#: op name -> True when it mixes tokens (its chunked result differs from the unchunked one)
OPS: dict[str, bool] = {
    "relu": False,
    "mm": False,
    "flatten": False,
    "baked_view": False,
    "as_strided": False,
    "zeros_like_add": False,
    "full": False,
    "scatter_add": False,
    "arange": True,
    "cumsum": True,
    "buffer": True,
    "item": True,
}

EXAMPLES = property_settings()


@dataclass(frozen=True)
class Recipe:
    ops: tuple[str, ...]
    tokens: int
    num_chunks: int
    symbolic: bool

    @property
    def mixing(self) -> bool:
        return any(OPS[o] for o in self.ops)


@st.composite
def recipes(draw: st.DrawFn) -> Recipe:
    ops = tuple(draw(st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=5)))
    n = draw(st.sampled_from([2, 4]))
    per_chunk = draw(st.sampled_from([2, 3]))
    return Recipe(ops, n * per_chunk, n, draw(st.booleans()))


def build(fake_graph: Any, r: Recipe, tokens: int) -> torch.fx.GraphModule:
    """The recipe's graph for ``tokens`` tokens (an unbacked extent hinted ``tokens`` in
    symbolic mode). Inputs: ``x`` [T, D], ``w`` [D, D], ``buf`` [D]."""
    b = fake_graph()
    t: Any = b.unbacked(tokens) if r.symbolic else tokens
    x = b.placeholder("x", b.fake(t, D))
    w = b.placeholder("w", b.fake(D, D))
    buf = b.placeholder("buf", b.fake(D))

    def op(target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        return b.op(target, *args, fqn=REGION, **kwargs)

    h = op(aten.relu.default, x)
    for name in r.ops:
        if name == "relu":
            h = op(aten.tanh.default, h)
        elif name == "mm":
            h = op(aten.mm.default, h, w)
        elif name == "flatten":
            h = op(aten.view.default, op(aten.view.default, h, [t * D]), [t, D])
        elif name == "baked_view":
            # the traced extent baked in as a constant (x.view(8, D) instead of x.view(-1, D))
            node = b.graph.call_function(aten.view.default, (h, [tokens, D]))
            node.meta["val"] = h.meta["val"]
            node.meta["custom"] = {"module_fqn": REGION}
            h = node
        elif name == "as_strided":
            h = op(aten.as_strided.default, op(aten.clone.default, h), [t, D], [D, 1])
        elif name == "zeros_like_add":
            h = op(aten.add.Tensor, op(aten.zeros_like.default, h), h)
        elif name == "full":
            h = op(aten.mul.Tensor, h, op(aten.full.default, [t, D], 0.5))
        elif name == "scatter_add":
            idx = op(aten.zeros_like.default, h, dtype=torch.int64)
            h = op(aten.scatter_add.default, op(aten.zeros_like.default, h), 1, idx, h)
        elif name == "arange":
            pos = op(aten.arange.default, t, dtype=torch.float32)
            h = op(aten.add.Tensor, h, op(aten.unsqueeze.default, pos, 1))
        elif name == "cumsum":
            h = op(aten.cumsum.default, h, 0)
        elif name == "buffer":
            total = op(aten.add.Tensor, buf, op(aten.sum.dim_IntList, h, [0]))
            op(aten.copy_.default, buf, total)
        elif name == "item":
            count = op(aten.sum.default, op(aten.gt.Scalar, h, 0.0))
            scalar = op(aten._local_scalar_dense.default, count)
            scalar.meta["unbacked_bindings"] = {scalar.meta["val"].node.expr: ()}
            h = op(aten.add.Tensor, h, scalar)
    return b.module(h)


def _inputs(r: Recipe) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(hash(r) % 2**31)
    return (
        torch.randn(r.tokens, D, generator=gen),
        torch.randn(D, D, generator=gen) / 2,
        torch.randn(D, generator=gen),
    )


def _config(r: Recipe) -> ChunkConfig:
    return ChunkConfig(
        module_patterns=("layers.*",),
        num_chunks=r.num_chunks,
        chunk_inputs=() if r.symbolic else ("x",),
    )


def _runnable(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    concretize_chunk_symbols(gm)
    gm.recompile()
    return gm


def _reference(fake_graph: Any, r: Recipe, x: torch.Tensor, w: torch.Tensor, buf: torch.Tensor):
    """The recipe at chunk size, run chunk after chunk: (cat of outputs, final buffer)."""
    per_chunk = _runnable(build(fake_graph, r, r.tokens // r.num_chunks))
    buf = buf.clone()
    outs = [per_chunk(piece, w, buf)[0] for piece in x.chunk(r.num_chunks)]
    return torch.cat(outs), buf


def _check(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def _run(gm: torch.fx.GraphModule, x: torch.Tensor, w: torch.Tensor, buf: torch.Tensor):
    buf = buf.clone()
    return gm(x, w, buf)[0], buf


@EXAMPLES
@given(r=recipes())
def test_every_accepted_graph_runs_and_matches(r: Recipe, fake_graph: Any) -> None:
    gm = build(fake_graph, r, r.tokens)
    before = snapshot(gm)
    try:
        report = chunk_pass(gm, _config(r))
    except ChunkError:
        assert snapshot(gm) == before, "a refusing chunk_pass modified the graph"
        return
    assert report.regions
    gm.graph.lint()
    gm = _runnable(gm)
    x, w, buf = _inputs(r)
    want = _reference(fake_graph, r, x, w, buf)
    _check(_run(gm, x, w, buf), want)  # eager: any accepted graph that cannot run fails here
    torch._dynamo.reset()
    compiled = torch.compile(gm, backend="aot_eager", fullgraph=True, dynamic=False)
    _check(_run(compiled, x, w, buf), want)  # type: ignore[arg-type]
    if not r.mixing:
        full = _runnable(build(fake_graph, r, r.tokens))
        _check(_run(full, x, w, buf), want)


@pytest.mark.parametrize("symbolic", [True, False], ids=["symbolic", "static"])
def test_every_pattern_is_exercised_and_accepted(symbolic: bool, fake_graph: Any) -> None:
    """The generator is not vacuous: every op the property draws is accepted on its own
    (except a baked size in symbolic mode, which must be refused), and runs."""
    for name in sorted(OPS):
        r = Recipe((name,), 4, 2, symbolic)
        gm = build(fake_graph, r, r.tokens)
        if name == "baked_view" and symbolic:
            with pytest.raises(ChunkError, match=r"the constant 4 is baked"):
                chunk_pass(gm, _config(r))
            continue
        chunk_pass(gm, _config(r))
        x, w, buf = _inputs(r)
        _check(_run(_runnable(gm), x, w, buf), _reference(fake_graph, r, x, w, buf))
