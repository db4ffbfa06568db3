"""Toy MLP stack, batch chunking of ``layers.*``: forward and backward regions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from ap_epchunk import ChunkConfig, chunk_pass, concretize_chunk_symbols
from ap_tags import CHUNK_GLUE, CHUNK_INDEX, CUSTOM, MODULE_FQN
from ap_testing.chunking import Stack, run_joint
from ap_testing.graphs import snapshot

aten = torch.ops.aten
D, LAYERS = 8, 2


@pytest.fixture
def setup(trace: Any) -> Callable[..., tuple[Any, ...]]:
    """``setup(n, symbolic, early)``: a traced MLP stack on ``4 * n`` tokens, its unchunked
    outputs and the matching ``ChunkConfig``."""

    def make(n: int, symbolic: bool, early: bool, seed: int = 0) -> tuple[Any, ...]:
        torch.manual_seed(seed)
        model = Stack(D, LAYERS)
        x, y = torch.randn(4 * n, D), torch.randn(4 * n, D)
        gm = trace(model, x, y, symbolic=symbolic)
        ref, _ = run_joint(gm, model, x, y)
        cfg = ChunkConfig(
            module_patterns=("layers.*",),
            num_chunks=n,
            early_grad_accumulation=early,
            chunk_inputs=() if symbolic else ("x_1", "y_1"),
        )
        return model, x, y, gm, ref, cfg

    return make


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "unbacked"])
@pytest.mark.parametrize("n", [2, 4])
def test_graph_chunking_equals_eager_chunking_bitwise(
    n: int, symbolic: bool, setup: Any, run_eager_chunked: Any
) -> None:
    model, x, y, gm, unchunked, cfg = setup(n, symbolic, early=False)
    report = chunk_pass(gm, cfg)
    assert {(r.root, r.backward) for r in report.regions} == {
        (f"layers.{i}", bw) for i in range(LAYERS) for bw in (False, True)
    }
    out, _ = run_joint(gm, model, x, y)
    eager, _ = run_eager_chunked(model, "layers", None, x, y, n)
    assert len(out) == len(eager) == 2 + 4 * LAYERS
    for got, want, full in zip(out, eager, unchunked, strict=True):
        assert torch.equal(got, want)
        torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-6)
    if symbolic:
        concretize_chunk_symbols(gm)
        again, _ = run_joint(gm, model, x, y)
        assert all(torch.equal(a, b) for a, b in zip(again, out, strict=True))


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "unbacked"])
def test_early_accumulation_sums_partials_before_the_transpose(symbolic: bool, setup: Any) -> None:
    model, x, y, gm, unchunked, cfg = setup(2, symbolic, early=True)
    chunk_pass(gm, cfg)
    out, _ = run_joint(gm, model, x, y)
    for got, full in zip(out, unchunked, strict=True):
        torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-6)
    output = next(iter(gm.graph.find_nodes(op="output")))
    weight_grads = [a for a in output.args[0][1:-1] if a.meta["val"].dim() == 2]
    assert weight_grads
    for g in weight_grads:  # t(...t(add(mm_chunk1, mm_chunk0))): transposes run once, on the sum
        while g.target is not aten.add.Tensor:
            assert g.target is aten.t.default and g.name.endswith("_full")
            g = g.args[0]
        assert [a.target for a in g.args] == [aten.mm.default] * 2


def test_structure_shared_params_single_split_no_cat_then_split(setup: Any) -> None:
    model, x, y, gm, _, cfg = setup(2, True, early=False)
    param_transposes = len(
        [n for n in gm.graph.nodes if n.target is aten.t.default and n.args[0].op == "placeholder"]
    )
    report = chunk_pass(gm, cfg)
    nodes = list(gm.graph.nodes)
    # parameters and parameter-only prep (t(W)) are shared, never duplicated
    assert param_transposes == len(
        [n for n in nodes if n.target is aten.t.default and n.args[0].op == "placeholder"]
    )
    # x is used by layers.0 forward and backward but split once; the loss grad once
    splits = [n for n in nodes if n.target is aten.split_with_sizes.default]
    assert sorted(n.args[0].name for n in splits) == ["mse_loss_backward", "x_1"]
    assert report.split_live_ins == ["x_1", "mse_loss_backward"]
    # adjacent chunked regions exchange chunks directly: no split consumes a cat
    cats = [n for n in nodes if n.target is aten.cat.default]
    assert len(cats) == 2  # the model output (for the loss) and the input gradient
    assert not any(s.args[0] in cats for s in splits)
    gm.graph.lint()


def test_new_nodes_carry_val_custom_and_readable_names(setup: Any) -> None:
    model, x, y, gm, _, cfg = setup(4, True, early=True)
    before = {n.name for n in gm.graph.nodes}
    chunk_pass(gm, cfg)
    names = {n.name for n in gm.graph.nodes}
    assert {f"addmm_chunk{i}" for i in range(4)} <= names
    assert {f"x_1_chunk{i}" for i in range(4)} <= names
    for node in gm.graph.nodes:
        custom = node.meta.get(CUSTOM, {})
        if CHUNK_INDEX in custom or CHUNK_GLUE in custom or node.name not in before:
            assert "val" in node.meta, node.name
            assert custom.get(MODULE_FQN, "").startswith("layers."), node.name
        if CHUNK_INDEX in custom and node.op == "call_function" and "_chunk" in node.name:
            assert node.name.endswith(f"_chunk{custom[CHUNK_INDEX]}")


def test_chunk_values_are_symbolic_halves_until_concretized(setup: Any) -> None:
    model, x, y, gm, _, cfg = setup(2, True, early=False)
    chunk_pass(gm, cfg)
    addmm0 = next(n for n in gm.graph.nodes if n.name == "addmm_chunk0")
    assert str(addmm0.meta["val"].shape[0]) == "(u0//2)"
    before = snapshot(gm)
    concretize_chunk_symbols(gm)
    assert snapshot(gm) != before
    assert addmm0.meta["val"].shape[0] == 4


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "unbacked"])
def test_batch_chunking_through_flattening_views(
    symbolic: bool, trace: Any, run_eager_chunked: Any
) -> None:
    # [B, S, D] inputs: nn.Linear flattens to [B*S, D] and back, so the chunk dim must be
    # carried through view/_unsafe_view shape lists (static) or symbolic sizes (unbacked)
    torch.manual_seed(0)
    model = Stack(D, 2)
    x, y = torch.randn(4, 3, D), torch.randn(4, 3, D)
    gm = trace(model, x, y, symbolic=symbolic)
    unchunked, _ = run_joint(gm, model, x, y)
    chunk_pass(
        gm,
        ChunkConfig(
            module_patterns=("layers.*",),
            early_grad_accumulation=False,
            chunk_inputs=() if symbolic else ("x_1", "y_1"),
        ),
    )
    if symbolic:
        concretize_chunk_symbols(gm)
    out, _ = run_joint(gm, model, x, y)
    eager, _ = run_eager_chunked(model, "layers", None, x, y, 2)
    for got, want, full in zip(out, eager, unchunked, strict=True):
        assert torch.equal(got, want)
        torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-6)


def test_tags_of_another_schema_are_refused_and_the_graph_untouched(setup: Any) -> None:
    """The chunk pass reads module FQNs through ap-tags: a node stamped by another tag-schema
    version is refused (``TagSchemaError``) before anything changes."""
    from ap_tags import TAG_SCHEMA, TagSchemaError

    _, _, _, gm, _, cfg = setup(2, symbolic=True, early=False)
    node = next(n for n in gm.graph.nodes if (n.meta.get(CUSTOM) or {}).get(MODULE_FQN))
    node.meta[CUSTOM] = {**node.meta[CUSTOM], TAG_SCHEMA: 999}
    before = snapshot(gm)
    with pytest.raises(TagSchemaError, match="tag schema 999"):
        chunk_pass(gm, cfg)
    assert snapshot(gm) == before
    chunked = [n for n in gm.graph.nodes if CHUNK_INDEX in (n.meta.get(CUSTOM) or {})]
    assert not chunked
