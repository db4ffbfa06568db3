"""torchtitan's MoE models with real expert parallelism: experts sharded over the ranks, tokens
exchanged with ``all_to_all_single``.

Built with torchtitan 0.3.0's own path, as its trainer does: the model config's sharding
config with EP on (``set_qwen3_sharding_config`` / ``set_deepseek_v3_sharding_config``),
``ParallelDims(dp_shard=W, ep=W, world_size=W, spmd_backend="partial_dtensor").build_mesh()``
and ``model.parallelize(parallel_dims)``. Each rank then holds ``num_experts / W`` experts as a
DTensor ``Shard(0)`` on the ``ep`` mesh, and every MoE layer's ``AllToAllTokenDispatcher``
exchanges per-expert token counts (``all_to_all_single``, then ``.tolist()`` of the split
sizes), dispatches the routed tokens to the ranks that own their experts and combines the
results back (two more ``all_to_all_single`` with uneven, rank-dependent splits). The dense
parameters are FSDP-sharded by the zoo's ``FsdpTrainStep`` as in every zoo row; the expert
DTensors stay local to their rank (``efsdp`` is 1 when ``ep`` equals the world).

CPU substitutions (:data:`CPU_SUBSTITUTIONS`), each needed on a machine without CUDA:

* ``torchtitan.distributed.parallel_dims.device_type = "cpu"``: the mesh is built on the
  module's ``device_type``, which is ``"cuda"`` there;
* ``set_spmd_backend("partial_dtensor")``: the dispatcher reads the process-wide SPMD backend
  at call time (its default, ``spmd_types``, needs a type-checked mesh);
* ``torch.testing._internal.distributed.fake_pg`` imported: ``build_mesh`` gives size-1 axes
  the ``fake`` backend;
* SDPA (torchtitan's ``ScaledDotProductAttention``) instead of flex attention, as in every
  zoo row;
* fp32 experts: ``GroupedExperts.forward`` casts tokens and weights to bf16 for
  ``torch._grouped_mm`` (a CUDA fast path); here the same three grouped matmuls run in fp32,
  so EP, stock and ap can be compared at fp32 tolerances.

These change process-wide state: call :func:`cpu_expert_parallel` once per process, in the
ranks' own processes (``zoo.ep`` spawns them).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from zoo.models._base import SEQ, ZooModel
from zoo.models.torchtitan_models import _finish, deepseek_v3_config, qwen3_moe_config

__all__ = [
    "CPU_SUBSTITUTIONS",
    "EP_MODELS",
    "cpu_expert_parallel",
    "deepseek_v3_ep",
    "ep_parallel_dims",
    "fp32_experts",
    "qwen3_moe_ep",
]

CPU_SUBSTITUTIONS = [
    'torchtitan.distributed.parallel_dims.device_type = "cpu" (mesh on CPU)',
    'set_spmd_backend("partial_dtensor") (the dispatcher reads it at call time)',
    "torch.testing._internal.distributed.fake_pg imported (size-1 mesh axes)",
    "inner attention: torchtitan ScaledDotProductAttention instead of flex",
    "fp32 experts: GroupedExperts' three grouped matmuls without the bf16 casts",
]


def cpu_expert_parallel() -> None:
    """The process-wide CPU substitutions above (idempotent)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.distributed.utils import set_spmd_backend

    parallel_dims.device_type = "cpu"
    set_spmd_backend("partial_dtensor")


def _fp32_grouped_experts(
    self: Any, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor
) -> torch.Tensor:
    """torchtitan's ``GroupedExperts.forward`` (0.3.0) without its bf16 casts."""
    w1, w2, w3 = self.w1_EFD, self.w2_EDF, self.w3_EFD
    if isinstance(w1, DTensor):
        w1, w2, w3 = w1.to_local(), w2.to_local(), w3.to_local()
    offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(x_RD, w1.transpose(-2, -1), offs=offsets))
    h = h * torch._grouped_mm(x_RD, w3.transpose(-2, -1), offs=offsets)
    out: torch.Tensor = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)
    return out


def fp32_experts(model: nn.Module) -> int:
    """Every ``GroupedExperts`` of ``model`` computes in fp32; returns how many."""
    from torchtitan.models.common.moe import GroupedExperts

    count = 0
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.forward = types.MethodType(_fp32_grouped_experts, module)
            count += 1
    return count


def ep_parallel_dims(world_size: int) -> Any:
    """torchtitan's ``ParallelDims`` for experts over the whole world (``ep = dp_shard =
    world_size``, partial-DTensor SPMD), its mesh built: what ``model.parallelize`` takes."""
    from torchtitan.distributed.parallel_dims import ParallelDims

    dims = ParallelDims(
        dp_replicate=1,
        dp_shard=world_size,
        cp=1,
        tp=1,
        pp=1,
        ep=world_size,
        world_size=world_size,
        spmd_backend="partial_dtensor",
    )
    dims.build_mesh()
    return dims


def _parallelize(world_size: int, fp32: bool) -> Any:
    def parallelize(model: nn.Module) -> None:
        model.parallelize(ep_parallel_dims(world_size))  # type: ignore[operator]
        if fp32:
            fp32_experts(model)

    return parallelize


def _world_size() -> int:
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("expert-parallel zoo models need torch.distributed initialised")
    return dist.get_world_size()


def qwen3_moe_ep(steps: int, *, fp32: bool = True) -> ZooModel:
    """``tt_qwen3_moe`` (2 MoE layers, 8 experts top-2) with its experts over the world;
    ``fp32=False``: torchtitan's own bf16 grouped matmuls."""
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    world = _world_size()
    cfg = qwen3_moe_config()
    set_qwen3_sharding_config(cfg, enable_sp=False, enable_ep=True)
    zm = _finish(
        "tt_qwen3_moe_ep" if fp32 else "tt_qwen3_moe_ep_bf16",
        f"tt_qwen3_moe with EP {world}: 8 experts top-2 over {world} ranks, "
        f"{'fp32' if fp32 else 'bf16'} experts",
        cfg,
        steps,
        bf16=not fp32,
        parallelize=_parallelize(world, fp32),
    )
    zm.notes += CPU_SUBSTITUTIONS[:3] + (CPU_SUBSTITUTIONS[4:] if fp32 else [])
    return zm


def deepseek_v3_ep(steps: int, *, fp32: bool = True) -> ZooModel:
    """``tt_deepseek_v3`` (1 dense + 1 MoE layer, 8 experts top-3, 2 shared) with its routed
    experts over the world; ``fp32=False``: torchtitan's own bf16 grouped matmuls."""
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

    world = _world_size()
    cfg = deepseek_v3_config()
    set_deepseek_v3_sharding_config(cfg, enable_sp=False, enable_ep=True)
    zm = _finish(
        "tt_deepseek_v3_ep" if fp32 else "tt_deepseek_v3_ep_bf16",
        f"tt_deepseek_v3 with EP {world}: 8 routed experts top-3 over {world} ranks, "
        f"2 shared, {'fp32' if fp32 else 'bf16'} experts",
        cfg,
        steps,
        bf16=not fp32,
        seq=SEQ,
        parallelize=_parallelize(world, fp32),
    )
    zm.notes += CPU_SUBSTITUTIONS[:3] + (CPU_SUBSTITUTIONS[4:] if fp32 else [])
    return zm


#: The expert-parallel models, by zoo name (built inside an initialised process group).
EP_MODELS: dict[str, Callable[[int], ZooModel]] = {
    "tt_qwen3_moe_ep": qwen3_moe_ep,
    "tt_deepseek_v3_ep": deepseek_v3_ep,
    # torchtitan's own bf16 experts: judged against stock Inductor's gap in the same run
    "tt_qwen3_moe_ep_bf16": functools.partial(qwen3_moe_ep, fp32=False),
    "tt_deepseek_v3_ep_bf16": functools.partial(deepseek_v3_ep, fp32=False),
}
