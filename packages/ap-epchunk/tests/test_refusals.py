"""Every refusal raises ChunkError naming the node/reason and leaves the graph unchanged."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ap_epchunk import ChunkConfig, ChunkError, chunk_pass
from ap_testing.chunking import Stack
from ap_testing.graphs import snapshot
from torch import nn

D = 8


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [S, D], one sequence
        q, k, v = self.qkv(x).split(x.shape[-1], dim=-1)
        scores = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        return scores @ v


class TokenStats(nn.Module):
    """Returns, besides the activation, a value reduced over the tokens (no chunk dim)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        return h, h.amax(dim=0)


class StatsModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([TokenStats(D)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, peak = self.layers[0](x)
        return h * peak


def _refuses(gm: torch.fx.GraphModule, config: ChunkConfig, match: str) -> ChunkError:
    before = snapshot(gm)
    with pytest.raises(ChunkError, match=match) as info:
        chunk_pass(gm, config)
    assert snapshot(gm) == before
    return info.value


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "unbacked"])
def test_sequence_chunking_across_attention(symbolic: bool, trace: Any) -> None:
    torch.manual_seed(0)
    model = Stack(D, 1, Attention)
    x, y = torch.randn(8, D), torch.randn(8, D)
    gm = trace(model, x, y, symbolic=symbolic)
    cfg = ChunkConfig(
        module_patterns=("layers.*",), chunk_inputs=() if symbolic else ("x_1", "y_1")
    )
    err = _refuses(
        gm, cfg, "sequence chunking across attention is not supported: in region 'layers.0'"
    )
    assert err.node_name is not None


def test_value_without_chunk_dim_escaping_to_full_users(trace: Any) -> None:
    torch.manual_seed(0)
    model = StatsModel()
    x, y = torch.randn(8, D), torch.randn(8, D)
    gm = trace(model, x, y, symbolic=True)
    err = _refuses(
        gm,
        ChunkConfig(module_patterns=("layers.*",)),
        "value without the chunk dim escapes region 'layers.0'",
    )
    assert err.node_name == "amax"
    # symbolic (hinted) marks: the fix is one sentence of its own, not a dangling "or"
    assert ". Fix: leave 'layers.0' unchunked" in str(err) and ". or" not in str(err)


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "unbacked"])
def test_chunk_extent_not_divisible(symbolic: bool, trace: Any) -> None:
    model = Stack(D, 1)
    x, y = torch.randn(6, D), torch.randn(6, D)
    gm = trace(model, x, y, symbolic=symbolic)
    cfg = ChunkConfig(
        module_patterns=("layers.*",), num_chunks=4, chunk_inputs=() if symbolic else ("x_1", "y_1")
    )
    err = _refuses(gm, cfg, "not divisible by num_chunks=4")
    assert err.node_name == "x_1"


def test_no_region_matched(trace: Any) -> None:
    model = Stack(D, 1)
    gm = trace(model, torch.randn(8, D), torch.randn(8, D), symbolic=True)
    _refuses(
        gm,
        ChunkConfig(module_patterns=("blocks.*",)),
        r"no region matched module_patterns \['blocks.\*'\].*layers",
    )


def test_no_chunk_dimension_and_unknown_chunk_input(trace: Any) -> None:
    model = Stack(D, 1)
    gm = trace(model, torch.randn(8, D), torch.randn(8, D), symbolic=False)
    _refuses(gm, ChunkConfig(module_patterns=("layers.*",)), "no chunk dimension")
    _refuses(
        gm,
        ChunkConfig(module_patterns=("layers.*",), chunk_inputs=("tokens",)),
        "chunk_inputs names no placeholder",
    )


def test_interleaved_regions(fake_graph: Any) -> None:
    aten = torch.ops.aten
    b = fake_graph()
    x = b.placeholder("x", b.fake(b.unbacked(8), 3))
    a1 = b.op(aten.relu.default, x, fqn="layers.0")
    b1 = b.op(aten.neg.default, a1, fqn="layers.1")
    a2 = b.op(aten.exp.default, b1, fqn="layers.0")  # layers.0 resumes after layers.1
    gm = b.module(a2)
    err = _refuses(gm, ChunkConfig(module_patterns=("layers.*",)), "interleaved regions")
    assert err.node_name == "neg_default"
    assert "Fix: leave 'layers.1' unchunked" in str(err)
    assert "mark_chunk_dim" not in str(err)


def test_interleaved_regions_sharing_a_creation_op_name_the_marks(fake_graph: Any) -> None:
    """A buffer two regions share (a ``zeros`` serving the forward and the backward's
    recomputation of a MoE under a min-cut first partition) is refused naming hinted marks
    and leaving the region unchunked; an interleaving of computed values names the latter."""
    aten = torch.ops.aten
    b = fake_graph()
    u = b.unbacked(8)
    x = b.placeholder("x", b.fake(u, 3))
    a0 = b.op(aten.relu.default, x, fqn="layers.0")
    zeros = b.op(aten.full.default, [u, 3], 0.0, fqn="layers.1")
    a1 = b.op(aten.add.Tensor, a0, zeros, fqn="layers.0")  # layers.0 reads it as a live-in
    b1 = b.op(aten.mul.Tensor, a1, zeros, fqn="layers.1")
    gm = b.module(b1)
    err = _refuses(gm, ChunkConfig(module_patterns=("layers.*",)), "interleaved regions")
    assert err.node_name == "full_default"
    assert "creates a buffer two regions share" in str(err)
    assert "Fix: mark the token inputs with ap_epchunk.mark_chunk_dim" in str(err)
    assert "leave 'layers.1' unchunked" in str(err)
