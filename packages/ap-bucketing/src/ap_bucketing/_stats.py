"""``BucketingStats``: what one bucketing invocation decided, and who gets told.

Each call of ``bucket_collectives`` (directly or through the patched torch function) produces one
record, logs it as one INFO line and hands it to every registered observer. Observers let a
trainer or a test see the decisions without monkeypatching.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ._checks import require_callable

log = logging.getLogger(__name__)

StatsObserver = Callable[["BucketingStats"], None]


@dataclass(frozen=True)
class BucketingStats:
    """Decisions of one bucketing invocation.

    Attributes:
        candidates: collectives that passed the caller's filters (each counted once).
        keys: independently bucketed groups: distinct keys, or runs of equal keys when
            ``non_adjacent=False``.
        buckets: buckets emitted (two or more members each).
        bucketed: collectives placed in an emitted bucket.
        max_span: largest (highest - lowest topological rank) over emitted buckets; 0 if none.
        closed_by_bytes: bucket closes because the next collective would exceed the byte cap.
        closed_by_span: bucket closes because the next collective would exceed the span cap
            (a close where both limits were hit counts in both).
        closed_by_repeat: bucket closes because the next collective gathers a parameter the
            bucket already gathers (a joint graph's forward gather and backward re-gather of
            one block; ``block_buckets`` only).
        skipped_dependent: collectives not bucketed because they depend on a member of the
            open bucket.
        skipped_unhinted: collectives left unbucketed because their size has no hint.
        max_topo_span: the span cap in force (``None`` = bytes only).
        elapsed_s: wall time of the invocation.
    """

    candidates: int
    keys: int
    buckets: int
    bucketed: int
    max_span: int
    closed_by_bytes: int
    closed_by_span: int
    closed_by_repeat: int
    skipped_dependent: int
    skipped_unhinted: int
    max_topo_span: int | None
    elapsed_s: float

    def log_line(self) -> str:
        return (
            f"ap_bucketing: {self.buckets} buckets ({self.bucketed} of {self.candidates} "
            f"collectives, {self.keys} keys), max_span={self.max_span}, closed "
            f"(bytes={self.closed_by_bytes}, span={self.closed_by_span}, "
            f"repeat={self.closed_by_repeat}), skipped "
            f"(dependent={self.skipped_dependent}, unhinted={self.skipped_unhinted}), "
            f"max_topo_span={self.max_topo_span}, {self.elapsed_s * 1e3:.2f} ms"
        )


_observers: list[StatsObserver] = []
_observers_lock = threading.Lock()


def add_stats_observer(observer: StatsObserver) -> None:
    """Call ``observer(stats)`` after every bucketing invocation in this process."""
    require_callable(observer, where="add_stats_observer", arg="observer")
    with _observers_lock:
        _observers.append(observer)


def remove_stats_observer(observer: StatsObserver) -> None:
    """Undo one ``add_stats_observer(observer)``; unknown observers raise ValueError."""
    with _observers_lock:
        try:
            _observers.remove(observer)
        except ValueError:
            raise ValueError(
                f"remove_stats_observer: stats observer {observer!r} is not registered"
            ) from None


@contextlib.contextmanager
def collect_stats() -> Iterator[list[BucketingStats]]:
    """Collect the stats of every invocation inside the block into the yielded list."""
    collected: list[BucketingStats] = []
    add_stats_observer(collected.append)
    try:
        yield collected
    finally:
        remove_stats_observer(collected.append)


def publish(stats: BucketingStats, extra: StatsObserver | None = None) -> None:
    """Log ``stats`` at INFO and deliver it to ``extra`` and every registered observer."""
    log.info("%s", stats.log_line())
    with _observers_lock:
        observers = list(_observers)
    if extra is not None:
        observers.insert(0, extra)
    for observer in observers:
        observer(stats)
