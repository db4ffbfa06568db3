"""FSDP-style sharding of *any* module, without parametrization.

:class:`FsdpTrainStep` owns this rank's dim-0 shard of every parameter of the wrapped model
(padded when dim 0 does not divide by the world size) and a copy of every buffer. Its forward
all-gathers each shard with torch's autograd-aware functional all-gather
(``all_gather_single_autograd``: ``_c10d_functional.all_gather_into_tensor`` + ``wait_tensor``
in the graph, reduce-scatter in the backward), trims the padding, and calls the original model
through ``torch.func.functional_call`` with the gathered parameters and the wrapper's buffers,
then the model's own loss function. The wrapped model is *not* a submodule: the only
parameters anyone (``precompile``, an optimizer) sees are the shards.

Parameters that are already DTensors (expert weights sharded over an expert-parallel mesh by
torchtitan's ``parallelize``) are registered as they are, neither sharded again nor gathered:
each rank owns its experts whole, and their gradients are complete on the owning rank (the
token exchange's backward brings every token's contribution home).

Why not parametrization: parametrized modules (SimpleFSDP) fail in
``PrecompiledModule.forward`` today (a known, separate issue); this wrapper keeps every model's
own code untouched and gives the graph the shape the ap passes target
(placeholder -> all_gather -> wait -> slice/view -> use).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor

from zoo.models._base import split_inputs

__all__ = ["FsdpTrainStep", "ShardSpec", "shard_rows"]

LossFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter was sharded: its FQN in the wrapped model, its full shape, and the
    padded dim-0 size (a multiple of the world size)."""

    fqn: str
    full_shape: tuple[int, ...]
    padded_rows: int

    @property
    def rows(self) -> int:
        return self.full_shape[0] if self.full_shape else 1


def shard_rows(full: torch.Tensor, world_size: int, rank: int) -> tuple[torch.Tensor, int]:
    """This rank's dim-0 slice of ``full`` (a 0-d tensor counts as one row), zero-padded so
    every rank holds the same number of rows. Returns ``(shard, padded_rows)``."""
    flat = full.detach().reshape(1) if full.dim() == 0 else full.detach()
    rows = flat.shape[0]
    per_rank = -(-rows // world_size)
    padded_rows = per_rank * world_size
    if padded_rows != rows:
        pad = flat.new_zeros((padded_rows - rows, *flat.shape[1:]))
        flat = torch.cat([flat, pad])
    return flat[rank * per_rank : (rank + 1) * per_rank].clone(), padded_rows


def _attr_name(fqn: str) -> str:
    return fqn.replace(".", "__")


class FsdpTrainStep(nn.Module):
    """``forward(*inputs) -> loss``: all-gather every parameter shard, run ``model`` on
    ``inputs[:n_model_inputs]`` with the gathered parameters, and return
    ``loss_fn(output, *inputs[n_model_inputs:])``.

    ``model_kwargs`` are constant keyword arguments of every model call (e.g.
    ``return_dict=False``). The wrapper's own inputs are positional (``precompile`` sees them as
    graph inputs); ``input_names`` hands them to the model by keyword.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        *,
        n_model_inputs: int,
        group: dist.ProcessGroup | None = None,
        model_kwargs: dict[str, Any] | None = None,
        input_names: tuple[str, ...] | None = None,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("FsdpTrainStep: torch.distributed is not initialised")
        pg = group if group is not None else dist.group.WORLD
        assert pg is not None
        self.group_name: str = pg.group_name
        self.world_size: int = dist.get_world_size(pg)
        self.rank: int = dist.get_rank(pg)
        # Not a submodule: its full parameters must stay invisible to precompile/optimizers.
        self._model: tuple[nn.Module] = (model,)
        self._loss_fn = loss_fn
        self.n_model_inputs = n_model_inputs
        self.model_kwargs = dict(model_kwargs or {})
        if input_names is not None and len(input_names) != n_model_inputs:
            raise ValueError(
                f"FsdpTrainStep: {len(input_names)} input_names for {n_model_inputs} model inputs"
            )
        self.input_names = input_names
        self.specs: list[ShardSpec] = []
        self.local_fqns: list[str] = []
        for fqn, param in model.named_parameters():  # tied parameters appear once
            if isinstance(param, DTensor):
                self.register_parameter(_attr_name(fqn), param)
                self.local_fqns.append(fqn)
                continue
            shard, padded = shard_rows(param, self.world_size, self.rank)
            self.register_parameter(_attr_name(fqn), nn.Parameter(shard, param.requires_grad))
            self.specs.append(ShardSpec(fqn, tuple(param.shape), padded))
        self.buffer_fqns: list[str] = []
        for fqn, buf in model.named_buffers():
            self.register_buffer(_attr_name(fqn), buf.detach().clone())
            self.buffer_fqns.append(fqn)

    @property
    def model(self) -> nn.Module:
        return self._model[0]

    def shard(self, fqn: str) -> torch.Tensor:
        """The shard of the wrapped model's parameter ``fqn`` (while ``precompile`` traces,
        the functional stand-in for it)."""
        param: torch.Tensor = getattr(self, _attr_name(fqn))
        return param

    def named_shards(self) -> list[tuple[str, torch.Tensor]]:
        """Every parameter this rank trains: the FSDP shards, then the parameters kept local
        (DTensors sharded by their own mesh)."""
        fqns = [s.fqn for s in self.specs] + self.local_fqns
        return [(fqn, self.shard(fqn)) for fqn in fqns]

    def gather(self, spec: ShardSpec) -> torch.Tensor:
        """All-gather one shard: the two autograd-registered functional ops that
        ``funcol.all_gather_single_autograd`` (the non-deprecated name of
        ``all_gather_tensor_autograd``) issues while tracing, with the wait issued at once in
        eager too (no ``AsyncCollectiveTensor`` whose lazy wait would outlive this call)."""
        shard = self.shard(spec.fqn)
        full: torch.Tensor = funcol.wait_tensor(  # type: ignore[no-untyped-call]
            torch.ops._c10d_functional.all_gather_into_tensor(
                shard, self.world_size, self.group_name
            )
        )
        if spec.padded_rows != spec.rows:
            full = full[: spec.rows]
        return full.view(spec.full_shape)

    def forward(self, *inputs: Any) -> torch.Tensor:
        state: dict[str, torch.Tensor] = {s.fqn: self.gather(s) for s in self.specs}
        for fqn in self.local_fqns:
            state[fqn] = getattr(self, _attr_name(fqn))
        for fqn in self.buffer_fqns:
            state[fqn] = getattr(self, _attr_name(fqn))
        model_args, kwargs, rest = split_inputs(
            inputs, self.n_model_inputs, self.model_kwargs, self.input_names
        )
        out = torch.func.functional_call(self.model, state, model_args, kwargs)
        return self._loss_fn(out, *rest)
