"""The rows of ``zoo.meshes`` and the real models they place on a mesh (issue #23, item 2).

A row is a model x a mesh x a loop. Three models, each parallelised the way its own library's
users do it, on torchtitan's ``ParallelDims`` mesh (``build_mesh``):

* ``tt_llama3``: torchtitan's Llama3 debug model (``zoo.models.torchtitan_models.llama3``);
  tensor parallelism by torchtitan's own sharding config (``set_llama3_sharding_config``,
  applied by ``model.parallelize(parallel_dims)``), then graph_trainer's
  ``apply_simple_fsdp``; loss: torchtitan's ``cross_entropy_loss`` over the token count;
* ``tt_qwen3_moe``: torchtitan's Qwen3-MoE debug model (``qwen3_moe``: 8 experts top-2, bf16
  grouped experts); TP by torchtitan's own ``set_qwen3_sharding_config(enable_sp=False,
  enable_ep=False)`` and ``model.parallelize`` (what graph_trainer's ``parallelize_qwen3``
  does with ep 1), then ``apply_simple_fsdp``; torchtitan's loss. Its bf16 experts make it a
  bf16 model: judged against stock ``torch.compile``'s gap in the same run, as ``zoo.run``
  judges it;
* ``hf_llama``: transformers' ``LlamaForCausalLM`` from a ``LlamaConfig`` (the zoo's
  ``hf_llama`` config, never a hub download); TP by ``torch.distributed.tensor.parallel.
  parallelize_module`` with the plan transformers ships for it (``LlamaConfig.
  base_model_tp_plan``: q/k/v/gate/up colwise, o/down rowwise; ``LlamaForCausalLM._tp_plan``:
  the LM head colwise with its output gathered), then ``apply_simple_fsdp``; loss: the model's
  own (``labels=``), as the zoo's HF models compute it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "MESH_MODELS",
    "ROWS",
    "MeshModel",
    "Row",
    "batches",
    "build",
    "hf_tp_plan",
    "parallel_dims",
    "torchtitan_loss",
    "unsharded_loss",
]


@dataclass(frozen=True)
class Row:
    """One model x mesh x loop: ``dp_replicate`` x ``dp_shard`` x ``tp`` ranks, ``micro``
    micro-batches per step, ``steps`` optimizer steps, a ``no_grad`` evaluation between steps
    (``eval``), bf16 parameters (``bf16``: ``MixedPrecisionPolicy(bf16, fp32)``), stock
    ``torch.compile`` run too (``stock``; always for a bf16 row or model)."""

    name: str
    dp_replicate: int = 1
    dp_shard: int = 2
    tp: int = 1
    micro: int = 1
    steps: int = 2
    eval: bool = False
    bf16: bool = False
    stock: bool = False
    model: str = "tt_llama3"

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def mesh(self) -> str:
        axes = [("dp_replicate", self.dp_replicate), ("fsdp", self.dp_shard), ("tp", self.tp)]
        return " x ".join(f"{n} {d}" for n, d in axes if d > 1)

    @property
    def bf16_judged(self) -> bool:
        """Judged against stock ``torch.compile``'s gap (bf16 parameters, or a model that
        computes partly in bf16), not the fp32 tolerances."""
        return self.bf16 or MESH_MODELS[self.model].bf16

    @property
    def runs_stock(self) -> bool:
        return self.stock or self.bf16_judged


ROWS: dict[str, Row] = {
    r.name: r
    for r in (
        # torchtitan Llama3 (names kept from the first record)
        Row("accum_eval", micro=2, eval=True),
        Row("bf16", bf16=True, stock=True),
        Row("hsdp_2x2", dp_replicate=2, steps=1),
        Row("fsdp_tp_2x2", tp=2, steps=1),
        # torchtitan Qwen3-MoE
        Row("qwen3_moe_accum_eval", micro=2, eval=True, model="tt_qwen3_moe"),
        Row("qwen3_moe_bf16", bf16=True, stock=True, model="tt_qwen3_moe"),
        Row("qwen3_moe_hsdp_2x2", dp_replicate=2, steps=1, model="tt_qwen3_moe"),
        Row("qwen3_moe_fsdp_tp_2x2", tp=2, steps=1, model="tt_qwen3_moe"),
        # transformers Llama
        Row("hf_llama_accum_eval", micro=2, eval=True, model="hf_llama"),
        Row("hf_llama_bf16", bf16=True, stock=True, model="hf_llama"),
        Row("hf_llama_hsdp_2x2", dp_replicate=2, steps=1, model="hf_llama"),
        Row("hf_llama_fsdp_tp_2x2", tp=2, steps=1, model="hf_llama"),
    )
}


# ----------------------------------------------------------------------------------------------
# losses and the compiled module


def torchtitan_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """torchtitan's trainer loss (``components.loss.cross_entropy_loss``: fp32, sum reduction;
    on vocabulary-sharded TP logits its loss-parallel ``_LossParallelCrossEntropy``) over the
    token count: the mean next-token loss."""
    from torchtitan.components.loss import cross_entropy_loss

    out: torch.Tensor = cross_entropy_loss(logits, targets) / targets.numel()
    return out


def hf_own_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A transformers causal LM's own loss (``labels=``, it shifts them itself), element 0 of
    the ``return_dict=False`` tuple, as the zoo's HF models are called."""
    from zoo.models._base import first_output

    return first_output(model(input_ids=input_ids, labels=labels, return_dict=False))


class _LossOf(nn.Module):
    """The parallelised model and its loss as one module (what is compiled)."""

    def __init__(self, model: nn.Module, loss: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self._loss = loss

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        return self._loss(self.model, *batch)


def _tt_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torchtitan_loss(model(tokens), targets)


# ----------------------------------------------------------------------------------------------
# the models


def hf_tp_plan(model: nn.Module) -> dict[str, Any]:
    """transformers' own tensor-parallel plan of ``model`` as torch ``ParallelStyle`` s: its
    config's ``base_model_tp_plan`` (module paths under the base model, ``*`` for the layer
    index) and the class's ``_tp_plan`` (the LM head). Styles other than ``colwise``,
    ``rowwise`` and ``colwise_gather_output`` are refused by name: they need transformers' own
    TP runtime, not ``parallelize_module``."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles: dict[str, Callable[[], Any]] = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    }
    prefix = str(getattr(model, "base_model_prefix", "model"))
    base = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    head = dict(getattr(type(model), "_tp_plan", None) or {})
    if not base:
        raise ValueError(f"hf_tp_plan: {type(model).__name__}'s config has no base_model_tp_plan")
    plan: dict[str, Any] = {}
    for path, style in [*((f"{prefix}.{p}", s) for p, s in base.items()), *head.items()]:
        if style not in styles:
            raise ValueError(
                f"hf_tp_plan: {type(model).__name__} plans {path!r} as {style!r}; "
                f"parallelize_module takes {sorted(styles)}"
            )
        plan[path] = styles[style]()
    return plan


def _tt_llama3(tp_plan: bool) -> nn.Module:
    from zoo.models.torchtitan_models import llama3

    return llama3(1, tp_plan=tp_plan).module


def _tt_qwen3_moe(tp_plan: bool) -> nn.Module:
    from zoo.models.torchtitan_models import qwen3_moe

    return qwen3_moe(1, tp_plan=tp_plan).module


def _hf_llama(tp_plan: bool) -> nn.Module:
    from zoo.models.hf_models import llama

    return llama(1).module


def _tt_parallelize(model: nn.Module, dims: Any) -> None:
    model.parallelize(dims)  # type: ignore[operator]


def _hf_parallelize(model: nn.Module, dims: Any) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, dims.get_mesh("tp"), hf_tp_plan(model))


def _tt_batch(tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tokens, targets


def _hf_batch(tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(input_ids, labels)``: labels are the input ids (the model shifts them itself)."""
    return tokens, tokens.clone()


@dataclass(frozen=True)
class MeshModel:
    """How a row builds its model (seed 0; ``build(tp_plan)``: with its own library's TP
    sharding config set when the row has a ``tp`` axis), applies tensor parallelism
    (``parallelize(model, parallel_dims)``), computes the loss (``loss(model, *batch)``) and
    forms a batch from ``(tokens, targets)``. ``bf16``: the model computes partly in bf16."""

    name: str
    build: Callable[[bool], nn.Module]
    parallelize: Callable[[nn.Module, Any], None]
    loss: Callable[..., torch.Tensor]
    batch: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]
    bf16: bool = False
    description: str = ""


MESH_MODELS: dict[str, MeshModel] = {
    m.name: m
    for m in (
        MeshModel(
            "tt_llama3",
            _tt_llama3,
            _tt_parallelize,
            _tt_loss,
            _tt_batch,
            description="torchtitan Llama3 debug model; TP: set_llama3_sharding_config",
        ),
        MeshModel(
            "tt_qwen3_moe",
            _tt_qwen3_moe,
            _tt_parallelize,
            _tt_loss,
            _tt_batch,
            bf16=True,
            description="torchtitan Qwen3-MoE debug model (bf16 grouped experts); "
            "TP: set_qwen3_sharding_config(enable_ep=False)",
        ),
        MeshModel(
            "hf_llama",
            _hf_llama,
            _hf_parallelize,
            hf_own_loss,
            _hf_batch,
            description="transformers LlamaForCausalLM; TP: parallelize_module with "
            "LlamaConfig.base_model_tp_plan + LlamaForCausalLM._tp_plan",
        ),
    )
}


# ----------------------------------------------------------------------------------------------
# the mesh, the parallelised model, the batches


def parallel_dims(row: Row) -> Any:
    """torchtitan's ``ParallelDims`` for ``row``, its mesh built on CPU."""
    from torchtitan.distributed.parallel_dims import ParallelDims

    from zoo.models.expert_parallel import cpu_expert_parallel

    cpu_expert_parallel()
    dims = ParallelDims(
        dp_replicate=row.dp_replicate,
        dp_shard=row.dp_shard,
        cp=1,
        tp=row.tp,
        pp=1,
        ep=1,
        world_size=row.world,
        spmd_backend="partial_dtensor",
    )
    dims.build_mesh()
    return dims


def build(row: Row, dims: Any) -> nn.Module:
    """``row``'s model (seed 0) on ``dims``: its library's TP plan when ``row.tp > 1``, then
    torchtitan's ``apply_simple_fsdp`` (with the row's ``MixedPrecisionPolicy``), wrapped with
    its loss."""
    from torchtitan.config import TrainingConfig
    from torchtitan.experiments.graph_trainer.common_utils import apply_simple_fsdp

    spec = MESH_MODELS[row.model]
    model = spec.build(row.tp > 1)
    if row.tp > 1:
        spec.parallelize(model, dims)
    training = TrainingConfig(
        mixed_precision_param="bfloat16" if row.bf16 else "float32",
        mixed_precision_reduce="float32",
    )
    model = apply_simple_fsdp(model, parallel_dims=dims, training=training)
    return _LossOf(model, spec.loss)


def unsharded_loss(row: Row, batch: tuple[torch.Tensor, ...]) -> float:
    """The same model (seed 0) unparallelised, fp32 parameters, on ``batch``: what a correct
    mesh's first loss equals (up to round-off), independent of eager-vs-compiled."""
    spec = MESH_MODELS[row.model]
    with torch.no_grad():
        return float(spec.loss(spec.build(False), *batch))


def _dp_index(row: Row, rank: int) -> int:
    """Which data-parallel replica ``rank`` is (the TP ranks of one replica share its data;
    torchtitan's mesh puts ``tp`` innermost)."""
    return rank // row.tp


Batch = tuple[torch.Tensor, ...]


def batches(row: Row, rank: int) -> tuple[list[Batch], Batch]:
    """This rank's micro-batches (``steps * micro``, in order) and the evaluation batch."""
    from zoo.models._base import token_batches

    form = MESH_MODELS[row.model].batch
    data = [
        form(*pair)
        for pair in token_batches(row.steps * row.micro + 1, seed=1000 + _dp_index(row, rank))
    ]
    return data[:-1], data[-1]
