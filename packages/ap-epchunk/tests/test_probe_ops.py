"""The static probe's per-op rules (``ap_epchunk._probe_ops``), one by one, on single nodes:
how a chunk of a creation op is made (or why it cannot be), which dims it may carry the tokens
along, where a view maps the chunk dim, and the ``index_put`` broadcast check torch's fake
kernel leaves out. The probe as a whole is tested through the pass (``test_static_broadcasts``,
``test_real_moe_patterns``); these pin each rule so a change to one shows where it broke."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx
from ap_epchunk._probe_ops import (
    check_index_put_values,
    chunked_creation_args,
    contiguous_strides,
    creation_dims,
    is_creation,
    view_out_dim,
)

aten = torch.ops.aten


def _node(target: Any, args: tuple[Any, ...], val: torch.Tensor) -> torch.fx.Node:
    graph = torch.fx.Graph()
    node = graph.call_function(target, args)
    node.meta["val"] = val
    return node


def test_a_zeros_chunks_the_size_at_the_chunk_dim() -> None:
    node = _node(aten.zeros.default, ([16, 4],), torch.empty(16, 4))
    assert is_creation(node)
    assert chunked_creation_args(node, 0, 2) == (([8, 4],), {})
    assert chunked_creation_args(node, 1, 2) == (([16, 2],), {})


def test_an_arange_chunks_only_from_zero_in_steps_of_one() -> None:
    """A chunk of ``arange(0, n)`` is ``arange(0, n / N)``: chunk-local positions. Any other
    start or step has no such chunk."""
    plain = _node(aten.arange.start, (0, 16), torch.arange(16))
    assert chunked_creation_args(plain, 0, 4) == ((0, 4), {})
    shifted = _node(aten.arange.start, (1, 17), torch.arange(1, 17))
    assert chunked_creation_args(shifted, 0, 4) is None
    stepped = _node(aten.arange.start_step, (0, 32, 2), torch.arange(0, 32, 2))
    assert chunked_creation_args(stepped, 0, 4) is None
    end_only = _node(aten.arange.default, (16,), torch.arange(16))
    assert chunked_creation_args(end_only, 0, 4) == ((4,), {})


def test_an_empty_strided_chunks_only_when_contiguous() -> None:
    dense = _node(aten.empty_strided.default, ([8, 6], [6, 1]), torch.empty(8, 6))
    assert chunked_creation_args(dense, 0, 2) == (([4, 6], [6, 1]), {})
    transposed = _node(aten.empty_strided.default, ([8, 6], [1, 8]), torch.empty(8, 6))
    assert chunked_creation_args(transposed, 0, 2) is None
    assert contiguous_strides([4, 0, 3]) == [3, 3, 1]  # a zero-size dim strides as size 1


def test_a_symbolic_or_missing_size_list_has_no_chunk() -> None:
    sizes: list[Any] = [16, "s0"]
    assert (
        chunked_creation_args(_node(aten.zeros.default, (sizes,), torch.empty(16, 4)), 0, 2) is None
    )
    assert chunked_creation_args(_node(aten.zeros.default, (), torch.empty(16, 4)), 0, 2) is None


def test_creation_dims_are_those_the_chunk_count_divides() -> None:
    node = _node(aten.full.default, ([6, 8, 3], 0.0), torch.empty(6, 8, 3))
    assert creation_dims(node, 2) == [0, 1]
    assert creation_dims(node, 3) == [0, 2]
    assert creation_dims(node, 4) == [1]


def test_an_expand_may_carry_the_tokens_only_along_the_dims_it_broadcasts() -> None:
    """``expand(grad, [8, 8])`` of a ``[1, 8]`` value: dim 1 is the source's own data, dim 0 a
    broadcast (the backward of a scalar loss), so only dim 0 can be chunked as a creation."""
    graph = torch.fx.Graph()
    src = graph.placeholder("g")
    src.meta["val"] = torch.empty(1, 8)
    node = graph.call_function(aten.expand.default, (src, [8, 8]))
    node.meta["val"] = torch.empty(8, 8)
    assert creation_dims(node, 2) == [0]
    lead = graph.call_function(aten.expand.default, (src, [4, 8, 8]))
    lead.meta["val"] = torch.empty(4, 8, 8)
    assert creation_dims(lead, 2) == [0, 1]  # a new leading dim, then the broadcast one


@pytest.mark.parametrize(
    ("in_shape", "c", "out_shape", "n", "want"),
    [
        ([4, 6, 8], 1, [4, 48], 2, 1),  # merged into the next dim: chunks stay contiguous
        ([4, 6, 8], 0, [24, 8], 2, 0),
        ([4, 6, 8], 1, [24, 8], 2, None),  # merged under an outer dim: chunks interleave
        ([8, 6], 0, [2, 4, 6], 2, 0),  # split: the outer part carries the chunks
        ([8, 6], 0, [2, 4, 6], 4, None),  # ... unless it is smaller than the chunk count
    ],
)
def test_a_view_maps_the_chunk_dim_only_where_chunks_stay_contiguous(
    in_shape: list[int], c: int, out_shape: list[int], n: int, want: int | None
) -> None:
    assert view_out_dim(in_shape, c, out_shape, n) == want


def test_an_index_put_with_values_of_the_full_size_fails_as_the_kernel_would() -> None:
    node = _node(aten.index_put.default, (), torch.empty(9, 8))
    self_t, index = torch.zeros(9, 8), [torch.arange(9)]
    check_index_put_values(node, (self_t, index, torch.ones(9, 8)), {})
    check_index_put_values(node, (self_t, index, torch.ones(8)), {})  # broadcasts
    with pytest.raises(RuntimeError, match=r"value tensor of shape \[18, 8\]"):
        check_index_put_values(node, (self_t, index, torch.ones(18, 8)), {})
    other = _node(aten.add.Tensor, (), torch.empty(9, 8))
    check_index_put_values(other, (self_t, index, torch.ones(18, 8)), {})  # not an index_put
