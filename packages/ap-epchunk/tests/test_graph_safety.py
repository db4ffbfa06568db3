"""Graph safety of chunk_pass and concretize_chunk_symbols over random models (hypothesis).

* ``chunk_pass`` (static token dim): either the chunked joint graph lints clean and computes
  the loss and every gradient of eager chunking (``EagerChunked``: bitwise with early gradient
  accumulation off, allclose with it on; for per-token recipes also allclose to the unchunked
  graph), or it raises ``ChunkError`` and the graph is exactly as it was (code and metas).
* ``concretize_chunk_symbols`` (hinted unbacked token dim, after ``chunk_pass``): either no
  chunk symbol is left anywhere (node args, ``meta["val"]``) and the outputs are unchanged, or
  it raises ``ChunkError`` and the graph is exactly as it was.
"""

from __future__ import annotations

from typing import Any

import sympy
import torch
from ap_epchunk import ChunkConfig, ChunkError, chunk_pass, concretize_chunk_symbols
from ap_testing.chunking import RandomModel, property_settings, random_models, run_joint
from ap_testing.graphs import snapshot
from hypothesis import given

SAFETY = property_settings()


def _config(m: RandomModel, symbolic: bool) -> ChunkConfig:
    return ChunkConfig(
        module_patterns=("layers.*",),
        num_chunks=m.num_chunks,
        early_grad_accumulation=m.early,
        chunk_inputs=() if symbolic else ("x_1", "y_1"),
    )


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal element for element, a NaN equal to a NaN: recipes that stack Gram products
    overflow to inf and then NaN, identically in both runs."""
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def _free_symbols(value: Any) -> set[str]:
    if isinstance(value, torch.Tensor):
        return {
            str(s)
            for d in (*value.shape, *value.stride())
            if isinstance(d, torch.SymInt)
            for s in sympy.sympify(d.node.expr).free_symbols
        }
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return {str(s) for s in value.node.expr.free_symbols}
    if isinstance(value, list | tuple):
        return set().union(*(_free_symbols(v) for v in value)) if value else set()
    return set()


@SAFETY
@given(m=random_models())
def test_chunk_pass_is_safe(m: RandomModel, trace: Any, run_eager_chunked: Any) -> None:
    gm = trace(m.model, m.x, m.y, symbolic=False)
    unchunked, _ = run_joint(gm, m.model, m.x, m.y)
    before = snapshot(gm)
    try:
        report = chunk_pass(gm, _config(m, symbolic=False))
    except ChunkError:
        assert snapshot(gm) == before, "a refusing chunk_pass modified the graph"
        return
    gm.graph.lint()
    assert report.regions
    out, _ = run_joint(gm, m.model, m.x, m.y)
    eager, _ = run_eager_chunked(m.model, "layers", None, m.x, m.y, m.num_chunks)
    assert len(out) == len(eager)
    for got, want in zip(out, eager, strict=True):
        if m.early:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        else:
            _assert_same(got, want)  # early accumulation off must equal EagerChunked bitwise
    if not m.token_mixing:
        for got, full in zip(out, unchunked, strict=True):
            torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-5)


@SAFETY
@given(m=random_models())
def test_concretize_chunk_symbols_is_safe(m: RandomModel, trace: Any) -> None:
    gm = trace(m.model, m.x, m.y, symbolic=True)
    try:
        report = chunk_pass(gm, _config(m, symbolic=True))
    except ChunkError:
        report = None  # concretization must also cope with an unchunked symbolic graph
    chunk_symbols = set(report.chunk_symbols) if report is not None else set()
    out_before, _ = run_joint(gm, m.model, m.x, m.y)
    before = snapshot(gm)
    try:
        concretize_chunk_symbols(gm)
    except ChunkError:
        assert snapshot(gm) == before, "a refusing concretization modified the graph"
        return
    gm.graph.lint()
    for node in gm.graph.nodes:
        left = (
            _free_symbols(node.meta.get("val")) | _free_symbols(list(node.args))
        ) & chunk_symbols
        assert not left, f"chunk symbols {left} left on {node.name}"
    out, _ = run_joint(gm, m.model, m.x, m.y)
    for got, want in zip(out, out_before, strict=True):
        _assert_same(got, want)
