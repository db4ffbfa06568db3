"""The second compile saves exactly what the first decided, on the patterns that broke it.

Small models written the way users write them (``nn.Embedding``, ``nn.LayerNorm``,
``F.rms_norm``, SDPA, ``nn.BatchNorm1d``, a bf16 ``silu``), through ``precompile`` +
``autoparallel_backend``: no min-cut fallback, the same saved storages (count, shapes, bytes)
as the first partition, the three "saved" measures in agreement, and numerics equal to eager.
The conformance zoo (``zoo/``) holds the same properties on models nobody here wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ap_backend
import ap_partitioner
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F


class RmsAttention(nn.Module):
    """Embedding -> RMSNorm -> qkv -> SDPA -> head (the model that showed backward nodes
    claiming saves: 10 tensors first, 15 replayed)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.qkv = nn.Linear(32, 96)
        self.head = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(self.emb(ids), (32,))
        q, k, v = self.qkv(h).view(2, 8, 3, 4, 8).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(a.transpose(1, 2).reshape(2, 8, 32)).pow(2).mean()


class LayerNormMlp(nn.Module):
    """Linear + nn.LayerNorm (every LayerNorm model used to fall back to min-cut)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.lin(x)))).pow(2).mean()


class Bf16Silu(nn.Module):
    """A bf16 ``silu`` that the second compile decomposes into an fp32 chain."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.up(x).to(torch.bfloat16)).float()
        return self.down(h).pow(2).mean()


class BatchNormMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.lin(x)))).pow(2).mean()


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "rms_attention": (RmsAttention, lambda: torch.randint(0, 64, (2, 8))),
    "layer_norm": (LayerNormMlp, lambda: torch.randn(8, 16)),
    "bf16_silu": (Bf16Silu, lambda: torch.randn(8, 16)),
    "batch_norm": (BatchNormMlp, lambda: torch.randn(8, 16)),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    """Every case compiles ``PrecompiledModule.forward``; without a reset Dynamo's automatic
    dynamic shapes would make the second case's compile symbolic."""
    torch.compiler.reset()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "first_partition"),
    # the default first partition for every case; "min_cut" (torch's ban on recomputing what a
    # backward matmul reads kept) and "default" for one each
    [(name, "min_cut_fusible") for name in sorted(CASES)]
    + [("rms_attention", "min_cut"), ("batch_norm", "default")],
)
def test_replay_saves_the_first_partitions_storages(name: str, first_partition: str) -> None:
    make, example = CASES[name]
    torch.manual_seed(0)
    eager = make()
    torch.manual_seed(0)
    model = make()
    x = example()
    ref_loss = eager(x)
    ref_loss.backward()

    reports: list[Any] = []
    pm = ap_backend.precompile(model, (x,), first_partition=first_partition)
    backend = ap_backend.autoparallel_backend(
        partitioner=ap_partitioner.SaveAllPartitioner(strict=True, on_report=reports.append)
    )
    loss = torch.compile(pm, backend=backend)(x)
    loss.backward()

    first, second = pm.first_partition, backend.saved[0]
    (report,) = reports
    assert not report.fell_back, report.fallback_reason
    if (name, first_partition) == ("batch_norm", "default"):
        # default_partition sees the exported graph: the first backward's
        # native_batch_norm_backward takes the running statistics as arguments (unused in
        # training), so the first partition saved them; the retraced, decomposed backward does
        # not read them, so the replay does not keep them alive (the min-cut first partition
        # traces decomposed, as the retrace does, and never saves them)
        assert first.nbytes - second.nbytes == 2 * 32 * 4
        assert second.count == first.count - 2
    else:
        # the same storages, shape for shape (no CSE on the replay, so nothing merges)
        assert second.signatures == first.signatures
        assert second.nbytes == first.nbytes
    # one definition of "saved": the partitioner's report counts exactly what the backend does
    assert (report.saved_activation_count, report.saved_activation_bytes) == (
        second.count,
        second.nbytes,
    )
    if name == "bf16_silu":
        # bf16: stock Inductor computes silu in fp32 too; its result is the reference (its own
        # gap to eager is 1.5e-4 here)
        torch.manual_seed(0)
        eager = make()
        ref_loss = torch.compile(eager)(x)
        ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(_grads(model), _grads(eager), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
