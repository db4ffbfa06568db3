"""``torch.nn.TransformerEncoder``: torch's own encoder stack in training mode (the slow path:
``MultiheadAttention`` + LayerNorm + ReLU FFN; the fused fast path is inference-only)."""

from __future__ import annotations

import torch
from torch import nn

from zoo.models._base import BATCH, SEQ, ZooModel

__all__ = ["transformer_encoder"]


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def transformer_encoder(steps: int) -> ZooModel:
    torch.manual_seed(0)
    d_model = 64
    layer = nn.TransformerEncoderLayer(
        d_model=d_model, nhead=4, dim_feedforward=128, dropout=0.0, batch_first=True
    )
    model = nn.TransformerEncoder(layer, num_layers=2, norm=nn.LayerNorm(d_model))
    model.train()
    gen = torch.Generator().manual_seed(0)
    batches: list[tuple[torch.Tensor, ...]] = [
        (
            torch.randn(BATCH, SEQ, d_model, generator=gen),
            torch.randn(BATCH, SEQ, d_model, generator=gen),
        )
        for _ in range(steps)
    ]
    return ZooModel(
        name="nn_transformer_encoder",
        library=f"torch {torch.__version__.split('+')[0]}",
        config=f"TransformerEncoder(d_model {d_model}, 4 heads, ff 128, 2 layers, final norm)",
        module=model,
        batches=batches,
        n_model_inputs=1,
        loss_fn=_mse,
        notes=["dropout=0.0, batch_first=True; MSE against a random target"],
    )
