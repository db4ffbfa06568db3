"""Image classifiers: torchvision ResNet-18 (BatchNorm) and a timm Vision Transformer
(LayerNorm, fused SDPA attention). Random init, 32x32 inputs, 10 classes.

Batch 16: a randomly initialised ResNet-18 trained on 4 images is ill-conditioned in fp32
itself (BatchNorm over 4 values per channel in ``layer4``): eager fp32 against eager fp64
differs by 9e-5 in the first step's gradients and 7e-2 after one SGD step, so no compiler
could meet rtol 1e-5 there. With 16 images eager fp32 is within 1e-5 of fp64 (first step) and
1.4e-5 (second step).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zoo.models._base import ZooModel

__all__ = ["resnet10t", "resnet18", "vit"]

_IMG_BATCH = 16


def _image_batches(steps: int, batch: int = _IMG_BATCH) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(batch, 3, 32, 32, generator=gen),
            torch.randint(0, 10, (batch,), generator=gen),
        )
        for _ in range(steps)
    ]


def _ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, labels)


def _classifier(
    name: str, library: str, config: str, model: nn.Module, batches: list[Any], note: str
) -> ZooModel:
    """A 10-class image classifier in training mode, judged by cross-entropy on its logits."""
    model.train()
    return ZooModel(
        name=name,
        library=library,
        config=config,
        module=model,
        batches=batches,
        n_model_inputs=1,
        loss_fn=_ce,
        notes=[note],
    )


def resnet18(steps: int) -> ZooModel:
    """torchvision ResNet-18 exactly as ``torchvision.models.resnet18(num_classes=10)`` builds
    it (BatchNorm in training mode: batch statistics, running-stat buffers updated)."""
    import torchvision

    torch.manual_seed(0)
    return _classifier(
        "tv_resnet18",
        f"torchvision {torchvision.__version__.split('+')[0]}",
        "resnet18(num_classes=10), 16x3x32x32 images",
        torchvision.models.resnet18(weights=None, num_classes=10),
        _image_batches(steps),
        "weights=None (random init); BatchNorm running stats are buffers",
    )


def resnet10t(steps: int) -> ZooModel:
    """timm ``resnet10t`` (``timm.create_model("resnet10t", pretrained=False)``): a ResNet with
    one basic block per stage, a deep 3-conv stem and average-pool downsampling; BatchNorm in
    training mode. Half of ResNet-18's kernels: the BatchNorm CNN of the fast test subset.
    Batch 32: with 16 images eager fp32 is 1.1e-2 away from fp64 after one SGD step (its
    last stage normalises 16 values per channel); with 32, 6e-6."""
    import timm

    torch.manual_seed(0)
    return _classifier(
        "timm_resnet10t",
        f"timm {timm.__version__}",
        "create_model('resnet10t', num_classes=10), 32x3x32x32 images",
        timm.create_model("resnet10t", pretrained=False, num_classes=10),
        _image_batches(steps, 32),
        "pretrained=False (random init); BatchNorm running stats are buffers",
    )


def vit(steps: int) -> ZooModel:
    """timm ``VisionTransformer`` (the class behind ``vit_tiny_patch16_224``) at a tiny size:
    patch embedding, class token, learned positions, LayerNorm, fused SDPA, GELU MLP."""
    import timm
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(
        img_size=32,
        patch_size=8,
        embed_dim=64,
        depth=2,
        num_heads=4,
        mlp_ratio=2.0,
        num_classes=10,
    )
    return _classifier(
        "timm_vit",
        f"timm {timm.__version__}",
        "VisionTransformer(img 32, patch 8, dim 64, depth 2, 4 heads)",
        model,
        _image_batches(steps),
        "random init; drop rates are timm's defaults (0)",
    )
