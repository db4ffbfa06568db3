"""What a zoo model builder returns, and the shared knobs every builder uses."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["BATCH", "SEQ", "VOCAB", "ZooModel", "split_inputs", "token_batches"]

#: Tiny sizes shared by the language models (the brief: batch 2-4, seq 16-32, vocab ~256).
BATCH = 2
SEQ = 16
VOCAB = 256

LossFn = Callable[..., torch.Tensor]


def split_inputs(
    inputs: Sequence[Any],
    n_model_inputs: int,
    model_kwargs: dict[str, Any],
    input_names: Sequence[str] | None,
) -> tuple[tuple[Any, ...], dict[str, Any], tuple[Any, ...]]:
    """One step's positional inputs as ``(model args, model kwargs, loss inputs)``: the first
    ``n_model_inputs`` go to the model (by keyword when ``input_names`` names them, next to
    the constant ``model_kwargs``), the rest to the loss after the model's output."""
    args = tuple(inputs[:n_model_inputs])
    kwargs = dict(model_kwargs)
    if input_names is not None:
        kwargs.update(zip(input_names, args, strict=True))
        args = ()
    return args, kwargs, tuple(inputs[n_model_inputs:])


@dataclass
class ZooModel:
    """One real architecture, ready for :class:`zoo.fsdp.FsdpTrainStep`.

    ``batches[i]`` is step ``i``'s positional inputs: the first ``n_model_inputs`` go to the
    model (by keyword when ``input_names`` names them), the rest to ``loss_fn(model_output,
    *rest)``. ``model_kwargs`` are constant keyword arguments of every model call. ``bf16`` marks a model that computes (partly) in bfloat16:
    its numerics are judged against stock Inductor's own gap, not fp32's rtol.
    """

    name: str
    library: str
    config: str
    module: nn.Module
    batches: list[tuple[torch.Tensor, ...]]
    n_model_inputs: int
    loss_fn: LossFn
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    input_names: tuple[str, ...] | None = None
    bf16: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    def split(
        self, batch: Sequence[Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any], tuple[Any, ...]]:
        """``batch`` as ``(model args, model kwargs, loss inputs)`` (:func:`split_inputs`)."""
        return split_inputs(batch, self.n_model_inputs, self.model_kwargs, self.input_names)


def token_batches(
    steps: int, *, vocab: int = VOCAB, batch: int = BATCH, seq: int = SEQ, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic ``(tokens, targets)`` pairs, one per step."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq), generator=gen)
        targets = torch.randint(0, vocab, (batch, seq), generator=gen)
        out.append((tokens, targets))
    return out


def cross_entropy_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token loss on ``(B, S, V)`` logits, computed in fp32."""
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def first_output(out: Any, *_: torch.Tensor) -> torch.Tensor:
    """The loss a HuggingFace model computed itself (``return_dict=False``: element 0)."""
    if isinstance(out, Sequence) and not isinstance(out, torch.Tensor):
        loss = out[0]
    else:
        loss = out.loss
    assert isinstance(loss, torch.Tensor)
    return loss
