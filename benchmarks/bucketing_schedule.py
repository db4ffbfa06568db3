"""Helper for benchmarks/bucketing.py: OverlapBucketingPass on a synthetic backward graph.

Builds a backward-like FSDP graph (per layer: re-gather the weight, two matmuls, reduce-scatter
the weight gradient) on a fake process group of 8 ranks, runs ``OverlapBucketingPass`` with CPU
estimators under several ``max_topo_span`` values, and reports ``max_consec_compute_between_rs``
before and after: the longer the run of matmuls between reduce-scatters, the more gradients are
alive at once.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist
from ap_bucketing import (
    BucketingConfig,
    OverlapBucketingPass,
    collect_stats,
    max_consec_compute_between_rs,
)
from ap_bucketing.synthetic import backward_like_graph


def schedule_rows(quick: bool) -> list[dict[str, Any]]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    layers = 8 if quick else 32
    spans: list[int | None] = [None, 1500, 100, 40]
    owns_pg = not dist.is_initialized()
    if owns_pg:
        dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    rows: list[dict[str, Any]] = []
    try:
        group = dist.group.WORLD.group_name  # type: ignore[union-attr]
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
    finally:
        if owns_pg:
            dist.destroy_process_group()
    return rows
