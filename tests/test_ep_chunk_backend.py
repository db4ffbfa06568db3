"""EP chunking of a user's own MoE through ``precompile`` + ``autoparallel_backend(ep_chunk=...)``
by the documented token route: ``ap_epchunk.mark_chunk_dim(t, dim, hint=None)`` on the tensors
the compiled module is first called with. No placeholder names, no private helper."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from ap_backend import autoparallel_backend, precompile
from ap_epchunk import ChunkConfig, EagerChunked, mark_chunk_dim
from ap_testing.chunking import MoEBlock, Stack
from torch import nn

pytestmark = pytest.mark.slow

D, TOKENS = 8, 16
CHUNK = ChunkConfig(("model.layers.*.moe",), num_chunks=2, early_grad_accumulation=False)


class Step(nn.Module):
    """A user's training step: a two-layer MoE stack and its loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.model(x), y)


def _model() -> Step:
    torch.manual_seed(0)
    return Step(Stack.of([MoEBlock(D), MoEBlock(D)]))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(TOKENS, D, generator=gen), torch.randn(TOKENS, D, generator=gen)


def _grads(step: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    loss = step(x, y)
    loss.backward()
    return [loss.detach(), *(p.grad.detach().clone() for p in step.parameters())]  # type: ignore[union-attr]


def test_ep_chunk_of_a_user_moe_through_marked_inputs() -> None:
    step = _model()
    chunked_eager = copy.deepcopy(step)
    for layer in chunked_eager.model.layers:
        layer.moe = EagerChunked(layer.moe, 0, 2)
    eager = _grads(copy.deepcopy(step), *_batch())
    reference = _grads(chunked_eager, *_batch())

    x, y = _batch()
    mark_chunk_dim(x, 0, hint=None)  # the token dim of every input that carries tokens
    mark_chunk_dim(y, 0, hint=None)
    pm = precompile(step, (x, y))
    backend = autoparallel_backend(ep_chunk=CHUNK)
    got = _grads(torch.compile(pm, backend=backend), x, y)

    (report,) = backend.chunk_reports
    assert report.mode == "static"
    assert {r.root for r in report.regions} == {"model.layers.0.moe", "model.layers.1.moe"}
    assert len(report.regions) == 4  # forward and backward of each
    assert report.mutation_chains  # the tokens_per_expert buffer, chunk after chunk
    for g, r, e in zip(got, reference, eager, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)  # EagerChunked
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)  # per-token model: eager too
    buffers = dict(pm.module.named_buffers())
    ref_buffers = dict(chunked_eager.named_buffers())
    for name, buf in buffers.items():
        torch.testing.assert_close(buf, ref_buffers[name.replace(".moe.", ".moe.module.")])


def test_without_a_mark_the_error_gives_the_route_that_works() -> None:
    step = _model()
    x, y = _batch()
    pm = precompile(step, (x, y))
    compiled = torch.compile(pm, backend=autoparallel_backend(ep_chunk=CHUNK))
    with pytest.raises(Exception, match=r"mark_chunk_dim\(x, dim, hint=\.\.\.\).*hint=None before"):
        compiled(x, y)


def test_a_hinted_chunk_mark_before_precompile_names_the_static_route() -> None:
    """``mark_chunk_dim(x, 0, hint=N)`` makes the dim an unbacked symbol, which a (static) first
    compilation cannot record: refused before any tracing, naming the input and the mark that
    works through the backend."""
    step = _model()
    x, y = _batch()
    mark_chunk_dim(x, 0, hint=TOKENS)
    with pytest.raises(ValueError) as e:
        precompile(step, (x, y))
    message = str(e.value)
    assert "x (args[0]) has its chunk dim 0 marked with" in message
    assert f"mark_chunk_dim(..., hint={TOKENS})" in message
    assert "mark_chunk_dim(t, 0, hint=None)" in message
