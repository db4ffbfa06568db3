"""Run zoo models through ``precompile`` + ``autoparallel_backend`` and measure each case.

One *case* is a model x a configuration:

* ``default``: ``autoparallel_backend()``;
* ``ac``: ``autoparallel_backend(enable_ac=True)``;
* ``full``: ``autoparallel_backend(enable_ac=True, bucketing=True, overlap_scheduling=True)``;
* ``stock``: plain ``torch.compile`` (Inductor) of the same sharded train step on the same
  rank's batches, no first compilation: stock Inductor's own gap in the same world (the
  tolerance of bf16 models; run automatically for them).

For the three ap configurations a case: builds the model (seeded), wraps it in
:class:`zoo.fsdp.FsdpTrainStep`, runs ``steps`` eager SGD steps as the reference, restores the
initial state, runs ``precompile`` and ``torch.compile(..., backend=autoparallel_backend(...))``
for the same steps, and records numerics, the three saved-activation measures, all-gather
outputs saved, fallbacks and compile times. Any exception is recorded (type and first line),
never raised.

``python -m zoo`` (see :mod:`zoo.__main__`) runs each case in its own subprocess; tests call
:func:`run_case` in-process.
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch._dynamo
from torch import nn
from torch.distributed.tensor import DTensor

from zoo.configs import (
    AP_CONFIGS,
    BACKEND_CONFIGS,
    BUCKET_FORM_CONFIGS,
    BUDGET_CONFIGS,
    CONFIGS,
    OPTION_CONFIGS,
)
from zoo.fsdp import FsdpTrainStep
from zoo.models import MODELS, ZooModel
from zoo.records import CaseResult, Report, Saved
from zoo.verdict import (
    FP32_GRAD_RTOL,
    FP32_RTOL,
    FP64_MULTIPLIER,
    Verdict,
    evaluate,
    matches_stock_where_undetermined,
    misses_fp32,
    numerics_tolerance,
    within_fp64_reference,
)

__all__ = [
    "AP_CONFIGS",
    "any_rank",
    "jitter_one_ulp",
    "BACKEND_CONFIGS",
    "BUCKET_FORM_CONFIGS",
    "BUDGET_CONFIGS",
    "CONFIGS",
    "OPTION_CONFIGS",
    "FP32_RTOL",
    "FP32_GRAD_RTOL",
    "GRAD_FLOOR",
    "CaseResult",
    "FP64_MULTIPLIER",
    "evaluate",
    "run_case",
    "within_fp64_reference",
    "matches_stock_where_undetermined",
    "numerics_tolerance",
    "Report",
    "Saved",
    "Verdict",
]

LR = 1e-2
#: sign patterns of the one-ulp parameter jitter that tells whether fp32 determines a
#: model's gradients (``zoo.kinks`` measures 8; the zoo's fp32 ResNets move on every one)
JITTER_SEEDS = 2


# ----------------------------------------------------------------------------------------------
# numerics


#: A gradient tensor whose largest entry is below this fraction of the step's largest gradient
#: entry is measured against that floor instead of its own scale: its reference is round-off
#: (e.g. attention key biases, whose gradient is mathematically zero: softmax ignores a
#: per-row constant). Without the floor, two round-off values compare at "relative error 1.6".
GRAD_FLOOR = 1e-3


def rel_err(got: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """Normwise relative error ``max|got - ref| / max(max|ref|, floor)``."""
    got, ref = got.detach().double(), ref.detach().double()
    if got.shape != ref.shape:
        return math.inf
    if ref.numel() == 0:
        return 0.0
    scale = max(float(ref.abs().max()), floor, 1e-30)
    return float((got - ref).abs().max()) / scale


def _loss_rel(got: Sequence[float], ref: Sequence[float]) -> float:
    return max(abs(g - r) / max(abs(r), 1e-12) for g, r in zip(got, ref, strict=True))


def _grads_rel(
    got: list[dict[str, torch.Tensor]], ref: list[dict[str, torch.Tensor]]
) -> tuple[float, str]:
    """Worst per-tensor normwise relative error over steps and parameters, each tensor scaled
    by ``max(max|ref|, GRAD_FLOOR * the step's largest |ref|)``; and where it occurred."""
    worst, where = 0.0, ""
    for step, (g_step, r_step) in enumerate(zip(got, ref, strict=True)):
        if g_step.keys() != r_step.keys():
            return math.inf, f"step {step + 1}: gradients of different parameters"
        top = max((float(r.abs().max()) for r in r_step.values() if r.numel()), default=0.0)
        for name, r in r_step.items():
            err = rel_err(g_step[name], r, GRAD_FLOOR * top)
            if err > worst:
                worst, where = err, f"step {step + 1} {name}"
    return worst, where


def _train(
    fn: Callable[..., torch.Tensor],
    params: Sequence[tuple[str, nn.Parameter]],
    batches: Sequence[tuple[torch.Tensor, ...]],
    on_first_step: Callable[[float], None] | None = None,
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """``len(batches)`` SGD steps; returns each step's loss and gradients (before the update)."""
    losses: list[float] = []
    grads: list[dict[str, torch.Tensor]] = []
    for step, batch in enumerate(batches):
        start = time.perf_counter()
        loss = fn(*batch)
        loss.backward()  # type: ignore[no-untyped-call]
        if step == 0 and on_first_step is not None:
            on_first_step(time.perf_counter() - start)
        losses.append(float(loss.detach()))
        grads.append(sgd_step(params))
    return losses, grads


def sgd_step(params: Sequence[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One plain SGD update (``LR``) of ``params``; returns each parameter's gradient (this
    rank's local part of a DTensor: an expert-parallel rank's own experts), cleared after."""
    step_grads: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in params:
            if p.grad is not None:
                grad = p.grad.detach()
                grad = grad.to_local() if isinstance(grad, DTensor) else grad
                step_grads[name] = grad.clone()
                p.sub_(LR * p.grad)
                p.grad = None
    return step_grads


class _State:
    """A copy of a module's parameters and buffers, restorable in place."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._tensors = {
            name: t.detach().clone()
            for name, t in [*module.named_parameters(), *module.named_buffers()]
        }

    def restore(self) -> None:
        with torch.no_grad():
            for name, t in [*self._module.named_parameters(), *self._module.named_buffers()]:
                t.copy_(self._tensors[name])
                if isinstance(t, nn.Parameter):
                    t.grad = None


def _rank_batches(zm: ZooModel, rank: int) -> list[tuple[torch.Tensor, ...]]:
    """Data parallel: each rank sees the steps' batches in a rotated order."""
    n = len(zm.batches)
    return [zm.batches[(i + rank) % n] for i in range(n)]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line}"[:400]


# ----------------------------------------------------------------------------------------------
# one case


def _saved(summary: Any) -> Saved:
    return Saved(
        count=int(summary.count),
        nbytes=int(summary.nbytes),
        all_gather=len(summary.all_gather_outputs),
        tensors=int(summary.tensor_count),
        storage_keys=[[str(d), int(b)] for d, b in summary.storage_keys],
        producers=list(getattr(summary, "producers", ())),
        producer_keys=[[str(d), int(b)] for d, b in getattr(summary, "producer_keys", ())],
    )


def _report(rep: Any) -> Report:
    return Report(
        saved_activation_count=int(rep.saved_activation_count),
        saved_activation_bytes=int(rep.saved_activation_bytes),
        saved_all_gather_count=int(rep.saved_all_gather_count),
        fell_back=bool(rep.fell_back),
        fallback_reason=rep.fallback_reason,
        dropped_first_saves=list(getattr(rep, "dropped_first_saves", ())),
        dropped_first_saves_why=list(getattr(rep, "dropped_first_saves_why", ())),
        narrowed_first_saves=list(getattr(rep, "narrowed_first_saves", ())),
        narrowed_storages=list(getattr(rep, "narrowed_storages", ())),
    )


def _describe(res: CaseResult, zm: ZooModel, steps: int, ranks: int) -> None:
    res.library = zm.library
    res.model_config = zm.config
    res.n_params = zm.n_params
    res.bf16 = zm.bf16
    res.steps = steps
    res.ranks = ranks
    res.notes = list(zm.notes)


def _sharded_step(zm: ZooModel, module: nn.Module | None = None) -> FsdpTrainStep:
    """``zm``'s model (or ``module``, a variant of it) FSDP-wrapped with ``zm``'s loss and call
    convention: the step every zoo case trains."""
    return FsdpTrainStep(
        zm.module if module is None else module,
        zm.loss_fn,
        n_model_inputs=zm.n_model_inputs,
        model_kwargs=zm.model_kwargs,
        input_names=zm.input_names,
    )


def _shard_params(step: FsdpTrainStep) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in step.named_shards() if isinstance(p, nn.Parameter)]


def _run_stock(res: CaseResult, zm: ZooModel, rank: int, stage: list[str]) -> None:
    """Plain ``torch.compile`` of the same sharded step as the ap cases, on the same rank's
    batches: stock Inductor's gap in the same world (at 2 ranks the gradients it is judged on
    are the reduce-scattered sums, as for the ap cases)."""
    step = _sharded_step(zm)
    params = _shard_params(step)
    batches = _rank_batches(zm, rank)
    state = _State(step)
    stage[0] = "eager"
    start = time.perf_counter()
    ref_losses, ref_grads = _train(step, params, batches)
    res.eager_s = time.perf_counter() - start
    state.restore()
    stage[0] = "stock torch.compile"
    compiled = torch.compile(step)

    def first_step(seconds: float) -> None:
        res.first_step_s = seconds

    losses, grads = _train(compiled, params, batches, first_step)
    _record_numerics(res, zm, rank, stage, (ref_losses, ref_grads), (losses, grads))
    res.stock_loss_rel, res.stock_grad_rel = res.loss_rel, res.grad_rel


Run = tuple[list[float], list[dict[str, torch.Tensor]]]


def _record_numerics(
    res: CaseResult, zm: ZooModel, rank: int, stage: list[str], eager: Run, compiled: Run
) -> None:
    """Loss and gradient errors against eager fp32; for an fp32 model that misses
    ``FP32_RTOL``, also both runs' distance to eager fp64 (see ``FP64_MULTIPLIER``)."""
    res.losses_eager, res.losses_compiled = eager[0], compiled[0]
    res.loss_rel = _loss_rel(compiled[0], eager[0])
    res.grad_rel, res.grad_worst = _grads_rel(compiled[1], eager[1])
    missed = misses_fp32(res.loss_rel, res.grad_rel, bf16=zm.bf16)
    # the references below run the sharded step, whose collectives every rank must join: a
    # rank that met the tolerances runs them too when another rank missed (its record keeps
    # them; ``zoo.worker._merge`` judges only the ranks that missed)
    if not any_rank(missed):
        return
    stage[0] = "eager fp64 reference"
    ref = _eager_fp64(res.model, res.steps, rank)
    res.fp64_eager_loss_rel = _loss_rel(eager[0], ref[0])
    res.fp64_eager_grad_rel = _grads_rel(eager[1], ref[1])[0]
    res.fp64_loss_rel = _loss_rel(compiled[0], ref[0])
    res.fp64_grad_rel = _grads_rel(compiled[1], ref[1])[0]
    stage[0] = "eager fp32, parameters jittered by one ulp"
    res.jitter_eager_grad_rel = max(
        _grads_rel(_eager_jittered(res.model, res.steps, rank, seed)[1], eager[1])[0]
        for seed in range(JITTER_SEEDS)
    )
    res.eager_undetermined = (
        res.fp64_eager_loss_rel > FP32_RTOL
        or res.fp64_eager_grad_rel > FP32_GRAD_RTOL
        or res.jitter_eager_grad_rel > FP32_GRAD_RTOL
    )


def any_rank(flag: bool) -> bool:
    """``flag`` or'ed over the default process group (``flag`` alone without one): the
    decision to run a reference that issues collectives, taken alike on every rank."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _eager_fp64(model: str, steps: int, rank: int) -> Run:
    """The same model (rebuilt from its seed), sharded the same way and trained on the same
    batches, in fp64."""
    zm = MODELS[model](steps)
    zm.module.double()
    step = _sharded_step(zm)
    batches = [
        tuple(t.double() if t.is_floating_point() else t for t in batch)
        for batch in _rank_batches(zm, rank)
    ]
    return _train(step, _shard_params(step), batches)


def jitter_one_ulp(module: nn.Module, seed: int) -> None:
    """Multiply every floating parameter element of ``module`` in place by ``1 +- 2**-24``
    (one fp32 ulp of it at most), the signs drawn from ``seed``: the same perturbation for
    the same seed, on every rank and in ``zoo.kinks``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point():
                sign = 2 * torch.randint(0, 2, p.shape, generator=gen, dtype=p.dtype) - 1
                p.mul_(1 + 2.0**-24 * sign)


def _eager_jittered(model: str, steps: int, rank: int, seed: int) -> Run:
    """The same model (rebuilt from its seed) with every parameter element multiplied by
    ``1 +- 2**-24`` (one ulp of fp32 at most; signs drawn from ``seed``, the same on every
    rank), sharded the same way and trained in fp32 on the same batches: how far fp32 rounding
    alone moves the gradients (see :func:`zoo.verdict.matches_stock_where_undetermined`)."""
    zm = MODELS[model](steps)
    jitter_one_ulp(zm.module, seed)
    step = _sharded_step(zm)
    return _train(step, _shard_params(step), _rank_batches(zm, rank))


def _run_ap(res: CaseResult, zm: ZooModel, config: str, rank: int, stage: list[str]) -> None:
    from ap_backend import autoparallel_backend, measure_saved, precompile

    step = _sharded_step(zm)
    params = _shard_params(step)
    res.n_shards = len(params)
    batches = _rank_batches(zm, rank)
    state = _State(step)

    stage[0] = "eager"
    start = time.perf_counter()
    ref_losses, ref_grads = _train(step, params, batches)
    res.eager_s = time.perf_counter() - start
    state.restore()
    res.losses_eager = ref_losses

    stage[0] = "precompile"
    start = time.perf_counter()
    pm = precompile(step, batches[0])
    res.precompile_s = time.perf_counter() - start
    state.restore()
    res.fsdp_chains = int(pm.fsdp_report.chains_found)
    res.first = _saved(pm.first_partition)
    res.first_partitioner = pm.first_partitioner
    if config == "default":
        stage[0] = "measure_saved(min_cut) on the tagged graph"
        res.tagged_min_cut = _saved(
            measure_saved(pm, batches[0], partitioner="min_cut", enable_ac=False)
        )
        state.restore()
        torch._dynamo.reset()

    stage[0] = "torch.compile(backend=autoparallel_backend)"
    if config in BUDGET_CONFIGS:
        budget = int(BUDGET_CONFIGS[config] * pm.first_partition.nbytes)
        backend = autoparallel_backend(activation_budget_bytes=budget)
    else:
        backend = autoparallel_backend(**BACKEND_CONFIGS[config])
    compiled = torch.compile(pm, backend=backend)

    def first_step(seconds: float) -> None:
        res.first_step_s = seconds

    try:
        losses, grads = _train(compiled, params, batches, first_step)
    finally:
        res.saveall = [_saved(s) for s in backend.saved]
        res.reports = [_report(r) for r in backend.partition_reports]
        res.backend_s = sum(backend.compile_seconds) if backend.compile_seconds else None
        res.backend_calls = len(backend.compile_seconds)
    _record_numerics(res, zm, rank, stage, (ref_losses, ref_grads), (losses, grads))
    if any_rank(bool(res.eager_undetermined)):
        stage[0] = "stock torch.compile (eager fp32 undetermined)"
        state.restore()
        torch._dynamo.reset()  # the step's frames compile afresh with stock Inductor
        stock = _train(torch.compile(step), params, batches)
        res.vs_stock_loss_rel = _loss_rel(losses, stock[0])
        res.vs_stock_grad_rel = _grads_rel(grads, stock[1])[0]


def run_case(
    model: str, config: str, *, steps: int = 2, rank: int = 0, ranks: int = 1
) -> CaseResult:
    """Run one case in this process (torch.distributed must be initialised for the ap
    configurations). Never raises for a model or backend failure: see ``CaseResult.error``."""
    if model not in MODELS:
        raise ValueError(f"run_case: unknown model {model!r}; known: {', '.join(MODELS)}")
    if config not in CONFIGS:
        raise ValueError(f"run_case: unknown config {config!r}; known: {', '.join(CONFIGS)}")
    res = CaseResult(model=model, config=config)
    stage = ["build"]  # where the case is, for the error record
    torch._dynamo.reset()
    try:
        zm = MODELS[model](steps)
        _describe(res, zm, steps, ranks)
        if config == "stock":
            _run_stock(res, zm, rank, stage)
        else:
            _run_ap(res, zm, config, rank, stage)
    except Exception as exc:  # noqa: BLE001 - the zoo records every failure and goes on
        res.error = _first_line(exc)
        res.error_stage = stage[0]
        res.notes.append("traceback tail: " + " | ".join(_tb_tail(exc)))
    finally:
        torch._dynamo.reset()
    return res


def _tb_tail(exc: BaseException, n: int = 2) -> list[str]:
    """The innermost ``n`` frames outside torch (the model or ap code that got there) and the
    innermost frame of all, as ``path:line function``."""
    frames = traceback.extract_tb(exc.__traceback__)

    def where(f: traceback.FrameSummary) -> str:
        return f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"

    outside = [f for f in frames if "site-packages/torch/" not in f.filename][-n:]
    tail = [where(f) for f in outside]
    if frames and (not outside or frames[-1] is not outside[-1]):
        tail.append(where(frames[-1]))
    return tail


# ----------------------------------------------------------------------------------------------
# the done-when properties
