"""What one zoo case records (``CaseResult``) and the saved-activation measures in it: plain
data, JSON round-trippable (``to_dict`` / ``from_dict``), judged by :mod:`zoo.verdict`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CaseResult", "Report", "Saved"]


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
    # "default" cases: torch's min-cut on the same tagged graph (the first compilation's
    # output, no AC), what the replay must not exceed
    tagged_min_cut: Saved | None = None
    # which partitioner the first compilation ran ("min_cut" / "default"; "" in older records)
    first_partitioner: str = ""
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
    # eager fp32 with its parameters jittered by one ulp against eager fp32 (the worst of
    # ``zoo.run.JITTER_SEEDS`` sign patterns; measured with the fp64 reference)
    jitter_eager_grad_rel: float | None = None
    # where that fp64 reference shows eager fp32 itself further from the exact answer than the
    # fp32 tolerances, or the jitter moves its gradients further (``eager_undetermined``), the
    # compiled run against plain torch.compile of the same step on the same batches (see
    # :func:`matches_stock_where_undetermined`)
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
        tagged = data.pop("tagged_min_cut", None)
        saveall = data.pop("saveall", [])
        reports = data.pop("reports", [])
        res = CaseResult(**data)
        res.first = Saved(**first) if first is not None else None
        res.tagged_min_cut = Saved(**tagged) if tagged is not None else None
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
