"""Helper for benchmarks/bucketing.py: OverlapBucketingPass on a synthetic backward graph.

Builds a backward-like FSDP graph (per layer: re-gather the weight, two matmuls, reduce-scatter
the weight gradient) on a fake process group of 8 ranks, runs ``OverlapBucketingPass`` with CPU
estimators under several ``max_topo_span`` values, and reports ``max_consec_compute_between_rs``
before and after: the longer the run of matmuls between reduce-scatters, the more gradients are
alive at once.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from ap_bucketing import (
    BucketingConfig,
    OverlapBucketingPass,
    collect_stats,
    max_consec_compute_between_rs,
)
from ap_testing.collectives import backward_like_graph
from ap_testing.distributed import fake_world


@contextlib.contextmanager
def _world() -> Iterator[str]:
    """The WORLD group's name: a fake world of 8 ranks, unless a process group already exists."""
    if dist.is_initialized():
        world = dist.group.WORLD
        assert world is not None
        yield world.group_name
    else:
        with fake_world() as group:
            yield group


def schedule_rows(quick: bool) -> list[dict[str, Any]]:
    layers = 8 if quick else 32
    spans: list[int | None] = [None, 1500, 100, 40]
    rows: list[dict[str, Any]] = []
    with _world() as group:
        for span in spans:
            gm = backward_like_graph(layers, group)
            nodes = len(gm.graph.nodes)
            before = max_consec_compute_between_rs(gm)
            bucketing_pass = OverlapBucketingPass(
                BucketingConfig(max_topo_span=span, bucket_cap_mb=1000.0), cpu=True
            )
            start = time.perf_counter()
            with collect_stats() as stats:
                bucketing_pass(gm.graph)
            elapsed = time.perf_counter() - start
            rows.append(
                {
                    "graph": f"backward-like, {layers} layers, {nodes} nodes",
                    "max_topo_span": span,
                    "before": before,
                    "after": max_consec_compute_between_rs(gm),
                    "buckets": sum(s.buckets for s in stats),
                    "pass_ms": elapsed * 1e3,
                }
            )
    return rows
