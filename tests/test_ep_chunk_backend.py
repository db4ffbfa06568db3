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
from ap_testing.chunking import MoE, MoEBlock, Stack
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
    with pytest.raises(
        Exception,
        match=r"mark_chunk_dim\(x, dim, hint=x.shape\[dim\]\) before trace_joint, precompile",
    ):
        compiled(x, y)


class UserNet(nn.Module):
    """A user's net as the issue's red team wrote it: Linear -> routed MoE -> LayerNorm ->
    Linear, optionally with its loss inside the compiled module."""

    def __init__(self, loss: str) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moe = MoE(D)
        self.norm = nn.LayerNorm(D)
        self.out = nn.Linear(D, D)
        self.loss = loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.out(self.norm(self.moe(self.inp(x))))
        if self.loss == "mean":
            return h.pow(2).mean()
        if self.loss == "sum":
            return h.pow(2).sum()
        if self.loss == "transposed":  # its backward moves the tokens to dim 1, then flattens
            return h.t().reshape(-1).pow(2).sum()
        return h  # the loss is the caller's (the ordinary torch.compile(model) use)


def _user_grads(net: nn.Module, x: torch.Tensor, loss: str) -> list[torch.Tensor]:
    out = net(x)
    value = F.cross_entropy(out, torch.arange(len(x)) % D) if loss == "outside" else out
    value.backward()
    return [value.detach(), *(p.grad.detach().clone() for p in net.parameters())]  # type: ignore[union-attr]


def _rel(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(
        float((g - w).norm() / w.norm().clamp_min(1e-30)) for g, w in zip(got, want, strict=True)
    )


USER_BATCH = 8
USER_CHUNK = ChunkConfig(("moe",), num_chunks=2)


@pytest.mark.parametrize("loss", ["mean", "sum", "outside"])
def test_a_user_net_chunks_through_hinted_marks(loss: str) -> None:
    """The three refusals of the static route (a scalar loss inside the module, whose backward
    expands to the full batch; the loss outside, whose tangent has the full batch at the
    LayerNorm's backward) chunk when the token dim is marked with its extent as hint: one
    unbacked symbol through precompile, Dynamo and the backend, concretized after chunking.
    A second batch (a fresh, unmarked tensor of the same shape) reuses the compiled graph."""
    torch.manual_seed(0)
    net = UserNet(loss)
    ref_net = copy.deepcopy(net)
    ref_net.moe = EagerChunked(ref_net.moe, 0, 2)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(USER_BATCH, D, generator=gen) for _ in range(2)]
    x = batches[0].clone()
    mark_chunk_dim(x, 0, hint=USER_BATCH)
    pm = precompile(net, (x,))
    backend = autoparallel_backend(ep_chunk=USER_CHUNK)
    compiled = torch.compile(pm, backend=backend)
    torch._dynamo.utils.counters.clear()
    for step, batch in enumerate(batches):
        ref = _user_grads(ref_net, batch.clone(), loss)
        got = _user_grads(compiled, x if step == 0 else batch.clone(), loss)
        assert _rel(got[:1], ref[:1]) <= 1e-6 and _rel(got, ref) <= 1e-5, (step, _rel(got, ref))
        for m in (ref_net, pm):
            m.zero_grad()
    (report,) = backend.chunk_reports  # one compilation for both batches
    assert report.mode == "symbolic"
    assert sorted(r.backward for r in report.regions) == [False, True]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("loss", ["mean", "sum", "outside"])
def test_a_user_net_chunks_through_static_marks(loss: str) -> None:
    """``mark_chunk_dim(x, 0, hint=None)`` (static sizes) on the same nets (issue 34, item 3):
    the scalar loss's backward broadcasts the loss gradient to the full batch
    (``expand(g, [8, 8])``: chunked like a creation op along the dim its consumer needs) and
    the loss outside the module hands in a full-batch tangent (chunk-sized along the dim its
    forward output carries); gradients equal ``EagerChunked`` and eager.

    Dynamo is reset first: run after the hinted test (which compiles the same
    ``PrecompiledModule`` code), this compile was refused at compile time at the MoE's
    ``full([8, 8])`` (the creation-op repair did not fire; presumably Dynamo's automatic
    dynamic shapes handed it symbolic sizes, which the static route does not read)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = UserNet(loss)
    ref_net = copy.deepcopy(net)
    ref_net.moe = EagerChunked(ref_net.moe, 0, 2)
    x = torch.randn(USER_BATCH, D, generator=torch.Generator().manual_seed(1))
    ref = _user_grads(ref_net, x.clone(), loss)
    eager = _user_grads(copy.deepcopy(net), x.clone(), loss)
    marked = mark_chunk_dim(x.clone(), 0, hint=None)
    pm = precompile(net, (marked,))
    backend = autoparallel_backend(ep_chunk=USER_CHUNK)
    got = _user_grads(torch.compile(pm, backend=backend), marked, loss)
    (report,) = backend.chunk_reports
    assert report.mode == "static"
    assert sorted(r.backward for r in report.regions) == [False, True]
    assert _rel(got[:1], ref[:1]) <= 1e-6 and _rel(got, ref) <= 1e-5, _rel(got, ref)
    assert _rel(got, eager) <= 1e-5, _rel(got, eager)


def test_the_static_route_refusal_names_the_hinted_route() -> None:
    """Where static sizes cannot say where the tokens went (the backward of
    ``h.t().reshape(-1)`` views the flat gradient back and moves the tokens to dim 1), the
    refusal names the node where propagation failed and the mark that works, at compile
    time."""
    torch.manual_seed(0)
    x = torch.randn(USER_BATCH, D)
    mark_chunk_dim(x, 0, hint=None)
    pm = precompile(UserNet("transposed"), (x,))
    compiled = torch.compile(pm, backend=autoparallel_backend(ep_chunk=USER_CHUNK))
    with pytest.raises(Exception, match=r"shape propagation of the chunk dim first failed") as e:
        compiled(x)
    assert "mark_chunk_dim(t, dim, hint=t.shape[dim]) instead of hint=None" in str(e.value)
