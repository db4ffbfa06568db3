"""The done-when properties of one zoo case (issue #23): numerics against eager fp32 (with the
fp64 and stock-compile judges where eager fp32 is no exact reference), fallbacks, all-gather
outputs saved, and the saved-set measures."""

from __future__ import annotations

from dataclasses import dataclass

from zoo.configs import BUDGET_CONFIGS
from zoo.records import CaseResult

__all__ = [
    "FP32_GRAD_RTOL",
    "FP32_RTOL",
    "FP64_MULTIPLIER",
    "Verdict",
    "evaluate",
    "matches_stock_where_undetermined",
    "numerics_tolerance",
    "within_fp64_reference",
]

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
    saveall_bytes_le_tagged_min_cut: bool | None = None

    def failures(self) -> list[str]:
        names = {
            "numerics": self.numerics,
            "fallbacks": self.no_fallbacks,
            "all-gather saved": self.no_all_gather_saved,
            "SaveAll bytes > first": self.saveall_bytes_le_first,
            "saved measures disagree": self.saved_agree,
            "replay differs from first": self.replay_exact,
            "SaveAll bytes > tagged min-cut": self.saveall_bytes_le_tagged_min_cut,
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


def misses_fp32(loss_rel: float | None, grad_rel: float | None, *, bf16: bool) -> bool:
    """Whether a compiled fp32 run missed the fp32 tolerances against its eager fp32: the
    runs the fp64, jitter and stock references are measured for and judge (a bf16 case never
    takes them; an unmeasured one has nothing to judge)."""
    if bf16 or loss_rel is None or grad_rel is None:
        return False
    return loss_rel > FP32_RTOL or grad_rel > FP32_GRAD_RTOL


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
    """Where eager fp32 is itself further from the eager fp64 answer than the fp32 tolerances,
    or eager fp32 on parameters jittered by one ulp is further than them from eager fp32
    (``eager_undetermined``), eager fp32 is no reference to hold a compiled run to those
    tolerances; the compiled run then passes when it computes what plain ``torch.compile``
    computes for the same step on the same batches, within the fp32 tolerances.

    Why such a model exists: a ReLU network whose BatchNorms normalise over few values
    (ResNets on 32x32 images: ``layer4`` sees 1x1 maps) has gradients that jump where a
    pre-activation crosses zero; after an SGD step some pre-activation sits within round-off
    of zero, and any change of rounding -- eager fp32 on parameters jittered by one ulp
    included -- lands on the other side of the kink and moves a BatchNorm's gradient by
    1e-3..1e-1 (``zoo/README.md``, "Two ranks"; ``python -m zoo.kinks``). The fp64
    distance alone misses half of such cases: eager fp32 may land on the fp64 answer's side of
    the kink by chance (torchvision's ResNet-18 at 2 ranks on an AVX2 CPU: eager fp32 2.5e-5
    from fp64, stock ``torch.compile`` 1.2e-1, one-ulp jitter of eager 1.7e-1 at 1 rank);
    the jitter shows that its side is chance. No fp32
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
    le_tagged: bool | None = None
    if res.tagged_min_cut is not None and res.saved_bytes is not None:
        le_tagged = res.saved_bytes <= res.tagged_min_cut.nbytes
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
        saveall_bytes_le_tagged_min_cut=le_tagged,
    )
