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

import dataclasses
import math
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._dynamo
from ap_bucketing import BucketingConfig
from torch import nn
from torch.distributed.tensor import DTensor

from zoo.fsdp import FsdpTrainStep
from zoo.models import MODELS, ZooModel

__all__ = [
    "AP_CONFIGS",
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
]

#: The backend options of each ap configuration.
AP_CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "ac": {"enable_ac": True},
    "full": {"enable_ac": True, "bucketing": True, "overlap_scheduling": True},
}
#: The full configuration with each of torch's bucket forms named explicitly (``full`` takes
#: ap-bucketing's default form): a user can pass either, so either must train correctly or be
#: refused. Not part of a whole-zoo run unless asked for (``--configs``).
BUCKET_FORM_CONFIGS: dict[str, dict[str, Any]] = {
    f"full_bucket_{mode}": {
        "enable_ac": True,
        "bucketing": BucketingConfig(bucket_mode=mode),
        "overlap_scheduling": True,
    }
    for mode in ("default", "custom_ops")
}
#: Each remaining backend option alone (issue #23 item 4: every option a user can pass runs at
#: 2 ranks or is refused): bucketing without overlap scheduling, overlap scheduling without
#: bucketing, torch's min-cut in place of the save-all replay. Not part of a whole-zoo run
#: unless asked for.
OPTION_CONFIGS: dict[str, dict[str, Any]] = {
    "bucket": {"bucketing": True},
    "overlap": {"overlap_scheduling": True},
    "min_cut": {"partitioner": "min_cut"},
}
#: The save-all replay under an activation budget, as a fraction of the first partition's saved
#: bytes (``autoparallel_backend(activation_budget_bytes=...)``, issue #25).
BUDGET_CONFIGS: dict[str, float] = {
    "budget_zero": 0.0,
    "budget_quarter": 0.25,
    "budget_half": 0.5,
    "budget_3q": 0.75,
}
CONFIGS: tuple[str, ...] = (
    "stock",
    *AP_CONFIGS,
    *BUCKET_FORM_CONFIGS,
    *OPTION_CONFIGS,
    *BUDGET_CONFIGS,
)

#: fp32 numerics criteria (normwise relative error, see :func:`rel_err`): the loss and every
#: gradient shard against eager fp32 -- issue #23's fp32 tolerances (loss 1e-5, gradients 1e-4).
FP32_RTOL = 1e-5
FP32_GRAD_RTOL = 1e-4
#: The second fp32 criterion, torch's own accuracy check (``torch._dynamo.utils.same`` with an
#: fp64 reference, as its benchmark runners use): where a model's eager fp32 is itself far from
#: the fp64 answer (an ill-conditioned model, e.g. BatchNorm over few values after an SGD
#: step), eager fp32 is no exact reference; the compiled run passes when it is no further from
#: eager fp64 than this many times eager fp32 is (both floored at ``FP32_RTOL``).
FP64_MULTIPLIER = 2.0
LR = 1e-2


@dataclass
class Saved:
    """One saved-activation measure (``ap_tags.counting``): distinct storages, bytes, all-gather
    outputs among them, saved activation tensors (views counted each) and the storages'
    sorted ``(dtype, bytes)`` keys (what storage-level equality compares; empty in results
    recorded before they were kept)."""

    count: int
    nbytes: int
    all_gather: int
    tensors: int = 0
    storage_keys: list[list[Any]] = field(default_factory=list)
    # per storage: the name a replay's report gives it and its [dtype, bytes] (first partition)
    producers: list[str] = field(default_factory=list)
    producer_keys: list[list[Any]] = field(default_factory=list)

    def keys_without(self, dropped: set[str]) -> list[list[Any]]:
        """``storage_keys`` less the storages a replay reported it did not keep."""
        keys = [list(k) for k in self.storage_keys]
        for producer, key in zip(self.producers, self.producer_keys, strict=True):
            if producer in dropped:
                keys.remove(list(key))
        return keys


@dataclass
class Report:
    """The fields of one ap-partitioner ``PartitionReport`` the zoo keeps."""

    saved_activation_count: int
    saved_activation_bytes: int
    saved_all_gather_count: int
    fell_back: bool
    fallback_reason: str | None
    dropped_first_saves: list[str] = field(default_factory=list)
    # why each of dropped_first_saves is not kept (aligned; empty in older records)
    dropped_first_saves_why: list[str] = field(default_factory=list)
    narrowed_first_saves: list[str] = field(default_factory=list)
    narrowed_storages: list[str] = field(default_factory=list)


@dataclass
class CaseResult:
    """Everything measured for one model x configuration (``None``: not reached)."""

    model: str
    config: str
    library: str = ""
    model_config: str = ""
    n_params: int = 0
    bf16: bool = False
    ranks: int = 1
    steps: int = 0
    # numerics vs eager (normwise relative error, max over steps, shards and ranks)
    loss_rel: float | None = None
    grad_rel: float | None = None
    grad_worst: str = ""
    losses_eager: list[float] = field(default_factory=list)
    losses_compiled: list[float] = field(default_factory=list)
    # FSDP structure of the first compilation
    n_shards: int = 0
    fsdp_chains: int | None = None
    # the three saved measures
    first: Saved | None = None
    saveall: list[Saved] = field(default_factory=list)
    reports: list[Report] = field(default_factory=list)
    # timings (seconds)
    eager_s: float | None = None
    precompile_s: float | None = None
    backend_s: float | None = None
    first_step_s: float | None = None
    backend_calls: int = 0
    # distance to eager fp64 of the same sharded step (measured only for an fp32 case whose
    # compiled run misses FP32_RTOL against eager fp32): eager fp32's and the compiled run's
    fp64_eager_loss_rel: float | None = None
    fp64_eager_grad_rel: float | None = None
    fp64_loss_rel: float | None = None
    fp64_grad_rel: float | None = None
    # where that fp64 reference shows eager fp32 itself further from the exact answer than the
    # fp32 tolerances (``eager_undetermined``), the compiled run against plain torch.compile of
    # the same step on the same batches (see :func:`matches_stock_where_undetermined`)
    eager_undetermined: bool | None = None
    vs_stock_loss_rel: float | None = None
    vs_stock_grad_rel: float | None = None
    # stock Inductor gap recorded for this model (filled in from its "stock" case)
    stock_loss_rel: float | None = None
    stock_grad_rel: float | None = None
    error: str | None = None
    error_stage: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> CaseResult:
        data = dict(data)
        first = data.pop("first", None)
        saveall = data.pop("saveall", [])
        reports = data.pop("reports", [])
        res = CaseResult(**data)
        res.first = Saved(**first) if first is not None else None
        res.saveall = [Saved(**s) for s in saveall]
        res.reports = [Report(**r) for r in reports]
        return res

    # -- derived -------------------------------------------------------------------------------
    @property
    def fallbacks(self) -> int:
        return sum(1 for r in self.reports if r.fell_back)

    @property
    def saved_count(self) -> int | None:
        return sum(s.count for s in self.saveall) if self.saveall else None

    @property
    def saved_bytes(self) -> int | None:
        return sum(s.nbytes for s in self.saveall) if self.saveall else None

    @property
    def report_count(self) -> int | None:
        return sum(r.saved_activation_count for r in self.reports) if self.reports else None

    @property
    def report_bytes(self) -> int | None:
        return sum(r.saved_activation_bytes for r in self.reports) if self.reports else None

    @property
    def all_gather_saved(self) -> tuple[int | None, int | None, int | None]:
        """All-gather outputs saved: (first partition, SaveAll, PartitionReport)."""
        first = self.first.all_gather if self.first is not None else None
        saved = sum(s.all_gather for s in self.saveall) if self.saveall else None
        rep = sum(r.saved_all_gather_count for r in self.reports) if self.reports else None
        return first, saved, rep


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
        step_grads: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, p in params:
                if p.grad is not None:
                    grad = p.grad.detach()
                    # an expert-parallel DTensor: compare this rank's experts
                    grad = grad.to_local() if isinstance(grad, DTensor) else grad
                    step_grads[name] = grad.clone()
                    p.sub_(LR * p.grad)
                    p.grad = None
        grads.append(step_grads)
    return losses, grads


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
    if zm.bf16 or (res.loss_rel <= FP32_RTOL and res.grad_rel <= FP32_GRAD_RTOL):
        return
    stage[0] = "eager fp64 reference"
    ref = _eager_fp64(res.model, res.steps, rank)
    res.fp64_eager_loss_rel = _loss_rel(eager[0], ref[0])
    res.fp64_eager_grad_rel = _grads_rel(eager[1], ref[1])[0]
    res.fp64_loss_rel = _loss_rel(compiled[0], ref[0])
    res.fp64_grad_rel = _grads_rel(compiled[1], ref[1])[0]
    res.eager_undetermined = (
        res.fp64_eager_loss_rel > FP32_RTOL or res.fp64_eager_grad_rel > FP32_GRAD_RTOL
    )


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


def _run_ap(res: CaseResult, zm: ZooModel, config: str, rank: int, stage: list[str]) -> None:
    from ap_backend import autoparallel_backend, precompile

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

    stage[0] = "torch.compile(backend=autoparallel_backend)"
    if config in BUDGET_CONFIGS:
        budget = int(BUDGET_CONFIGS[config] * pm.first_partition.nbytes)
        backend = autoparallel_backend(activation_budget_bytes=budget)
    else:
        backend = autoparallel_backend(
            **{**AP_CONFIGS, **BUCKET_FORM_CONFIGS, **OPTION_CONFIGS}[config]
        )
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
    if res.eager_undetermined:
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


@dataclass(frozen=True)
class Verdict:
    """Each done-when property of one case: ``True`` holds, ``False`` fails, ``None`` not
    measurable (the case failed earlier, or the property does not apply)."""

    numerics: bool | None
    no_fallbacks: bool | None
    no_all_gather_saved: bool | None
    saveall_bytes_le_first: bool | None
    saved_agree: bool | None
    replay_exact: bool | None
    error: bool
    within_budget: bool | None = None

    def failures(self) -> list[str]:
        names = {
            "numerics": self.numerics,
            "fallbacks": self.no_fallbacks,
            "all-gather saved": self.no_all_gather_saved,
            "SaveAll bytes > first": self.saveall_bytes_le_first,
            "saved measures disagree": self.saved_agree,
            "replay differs from first": self.replay_exact,
            "over budget": self.within_budget,
        }
        out = ["error"] if self.error else []
        return out + [k for k, v in names.items() if v is False]


def numerics_tolerance(res: CaseResult) -> tuple[float, float] | None:
    """(loss, grad) tolerance: fp32 rtol, or for bf16 models stock Inductor's own gap (never
    below the fp32 rtol). ``None`` when a bf16 model's stock gap is unknown."""
    if not res.bf16:
        return FP32_RTOL, FP32_GRAD_RTOL
    if res.stock_loss_rel is None or res.stock_grad_rel is None:
        return None
    return max(res.stock_loss_rel, FP32_RTOL), max(res.stock_grad_rel, FP32_GRAD_RTOL)


def within_fp64_reference(res: CaseResult) -> bool:
    """torch's fp64-referenced accuracy check: the compiled run is no further from eager fp64
    than ``FP64_MULTIPLIER`` x eager fp32 is (loss and gradients, each floored at
    ``FP32_RTOL``). ``False`` when the fp64 reference was not measured."""
    pairs = [
        (res.fp64_loss_rel, res.fp64_eager_loss_rel, FP32_RTOL),
        (res.fp64_grad_rel, res.fp64_eager_grad_rel, FP32_GRAD_RTOL),
    ]
    return all(
        got is not None and ref is not None and got <= FP64_MULTIPLIER * max(ref, tol)
        for got, ref, tol in pairs
    )


def matches_stock_where_undetermined(res: CaseResult) -> bool:
    """Where eager fp32 is itself further from the eager fp64 answer than the fp32 tolerances
    (``eager_undetermined``), eager fp32 is no reference to hold a compiled run to those
    tolerances; the compiled run then passes when it computes what plain ``torch.compile``
    computes for the same step on the same batches, within the fp32 tolerances.

    Why such a model exists: a ReLU network whose BatchNorms normalise over few values
    (ResNets on 32x32 images: ``layer4`` sees 1x1 maps) has gradients that jump where a
    pre-activation crosses zero; after an SGD step some pre-activation sits within round-off
    of zero, and any change of rounding -- eager fp32 on parameters jittered by one ulp
    included -- lands on the other side of the kink and moves a BatchNorm's gradient by
    1e-3..1e-1 (``zoo/README.md``, "Two ranks"; ``python -m zoo.kinks``). No fp32
    implementation other than eager's own kernels in eager's own order can meet 1e-4 there,
    so the check that still tells a wrong graph from a rounding change is the ap graph
    against stock Inductor's."""
    return (
        res.eager_undetermined is True
        and res.vs_stock_loss_rel is not None
        and res.vs_stock_grad_rel is not None
        and res.vs_stock_loss_rel <= FP32_RTOL
        and res.vs_stock_grad_rel <= FP32_GRAD_RTOL
    )


def evaluate(res: CaseResult) -> Verdict:
    """The done-when properties of one ap case."""
    tol = numerics_tolerance(res)
    numerics: bool | None = None
    if res.loss_rel is not None and res.grad_rel is not None and tol is not None:
        numerics = res.loss_rel <= tol[0] and res.grad_rel <= tol[1]
        if not numerics and not res.bf16:
            numerics = within_fp64_reference(res) or matches_stock_where_undetermined(res)
    no_fallbacks = (res.fallbacks == 0) if res.reports else None
    ag = res.all_gather_saved
    no_ag = None if any(a is None for a in ag) else all(a == 0 for a in ag)
    le_first: bool | None = None
    agree: bool | None = None
    exact: bool | None = None
    if res.first is not None and res.saveall and res.reports:
        saved_pair = (res.saved_count, res.saved_bytes)
        report_pair = (res.report_count, res.report_bytes)
        # one definition of "saved": the backend's summary and the partitioner's report of
        # the same partition count the same storages
        agree = saved_pair == report_pair
        if res.config == "default":  # AC may add stage-boundary saves to the replay
            le_first = (res.saved_bytes or 0) <= res.first.nbytes
            # storage level: the same multiset of (dtype, bytes) storages, not the same
            # tensors (a view of a saved base is free: the backward rebuilds it), less the
            # first-partition saves the replay reports the retraced backward never reads
            keys = sorted(k for s in res.saveall for k in s.storage_keys)
            dropped = {d for r in res.reports for d in r.dropped_first_saves}
            # a lossless widening cast saved as its narrow source: the first partition's cast
            # is not kept, the source's storage (when not saved anyway) is kept in its place
            narrowed = {d for r in res.reports for d in r.narrowed_first_saves}
            added = {d for r in res.reports for d in r.narrowed_storages}
            expected = (
                sorted(res.first.keys_without(dropped | narrowed)) if dropped | narrowed else None
            )
            if expected is not None:
                keys = sorted(k for s in res.saveall for k in s.keys_without(added))
                exact = expected == keys
            else:
                exact = (res.first.count, res.first.nbytes) == saved_pair and (
                    not res.first.storage_keys or sorted(res.first.storage_keys) == keys
                )
    within_budget: bool | None = None
    if res.config in BUDGET_CONFIGS and res.first is not None and res.saved_bytes is not None:
        within_budget = res.saved_bytes <= int(BUDGET_CONFIGS[res.config] * res.first.nbytes)
    return Verdict(
        within_budget=within_budget,
        numerics=numerics,
        no_fallbacks=no_fallbacks,
        no_all_gather_saved=no_ag,
        saveall_bytes_le_first=le_first,
        saved_agree=agree,
        replay_exact=exact,
        error=res.error is not None,
    )
