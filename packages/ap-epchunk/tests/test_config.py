"""ChunkConfig validation, mark_chunk_dim and EagerChunked contracts."""

from __future__ import annotations

import pytest
import torch
from ap_epchunk import ChunkConfig, ChunkError, EagerChunked, mark_chunk_dim
from torch import nn


@pytest.mark.parametrize(
    ("kwargs", "exc", "field"),
    [
        ({"module_patterns": ()}, ValueError, "module_patterns"),
        ({"module_patterns": ("",)}, ValueError, "module_patterns"),
        ({"module_patterns": 3}, TypeError, "module_patterns"),
        ({"module_patterns": ("a", 1)}, TypeError, "module_patterns"),
        ({"dim": -1}, ValueError, "dim"),
        ({"dim": 1.5}, TypeError, "dim"),
        ({"num_chunks": 1}, ValueError, "num_chunks"),
        ({"num_chunks": True}, TypeError, "num_chunks"),
        ({"num_chunks": "2"}, TypeError, "num_chunks"),
        ({"early_grad_accumulation": "yes"}, TypeError, "early_grad_accumulation"),
        ({"chunk_inputs": ("",)}, ValueError, "chunk_inputs"),
        ({"chunk_inputs": 3}, TypeError, "chunk_inputs"),
    ],
)
def test_bad_config_options_name_the_field(
    kwargs: dict[str, object], exc: type[Exception], field: str
) -> None:
    """A wrong type is a TypeError, a right type with a wrong value a ValueError."""
    base: dict[str, object] = {"module_patterns": ("layers.*",)}
    base.update(kwargs)
    with pytest.raises(exc, match=f"^ChunkConfig: {field} must") as info:
        ChunkConfig(**base)  # type: ignore[arg-type]
    assert type(info.value) is exc


def test_config_defaults_and_single_pattern_string() -> None:
    cfg = ChunkConfig(module_patterns="layers.*.moe")  # type: ignore[arg-type]
    assert cfg.module_patterns == ("layers.*.moe",)
    assert (cfg.dim, cfg.num_chunks, cfg.early_grad_accumulation) == (0, 2, True)


def test_mark_chunk_dim_marks_unbacked_with_hint() -> None:
    x = torch.randn(8, 4)
    assert mark_chunk_dim(x, 0, hint=8) is x
    assert 0 in x._dynamo_unbacked_indices  # type: ignore[attr-defined]
    assert x._dynamo_hint_overrides[0] == 8  # type: ignore[attr-defined]
    static = mark_chunk_dim(torch.randn(8, 4), -2, hint=None)
    assert not hasattr(static, "_dynamo_unbacked_indices")
    with pytest.raises(ChunkError, match="0-d"):
        mark_chunk_dim(torch.tensor(1.0), 0, hint=2)
    with pytest.raises(ChunkError, match="hint must be an int >= 2"):
        mark_chunk_dim(torch.randn(8), 0, hint=1)


@pytest.mark.parametrize(
    ("args", "hint", "arg"),
    [
        (("x", 0), 4, "tensor"),
        ((torch.randn(4), 1.5), 4, "dim"),
        ((torch.randn(4), True), 4, "dim"),
        ((torch.randn(4), 0), "4", "hint"),
        ((torch.randn(4), 0), 4.0, "hint"),
    ],
)
def test_mark_chunk_dim_wrong_types_are_type_errors(
    args: tuple[object, object], hint: object, arg: str
) -> None:
    with pytest.raises(TypeError, match=f"^mark_chunk_dim: {arg} must be"):
        mark_chunk_dim(*args, hint=hint)  # type: ignore[arg-type]


def test_eager_chunked_runs_each_chunk_and_concatenates() -> None:
    seen: list[int] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            seen.append(x.shape[0])
            return x * 2, x + 1

    x = torch.arange(12.0).view(6, 2)
    a, b = EagerChunked(Probe(), 0, 3)(x)
    assert seen == [2, 2, 2]
    assert torch.equal(a, x * 2) and torch.equal(b, x + 1)
    with pytest.raises(ChunkError, match="not divisible"):
        EagerChunked(Probe(), 0, 4)(x)
    with pytest.raises(ValueError, match="num_chunks"):
        EagerChunked(Probe(), 0, 1)
    with pytest.raises(TypeError, match="EagerChunked: dim must be an int"):
        EagerChunked(Probe(), 0.5, 2)  # type: ignore[arg-type]
