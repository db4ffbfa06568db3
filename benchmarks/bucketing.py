"""Bucketing benchmark: ap-bucketing's patched functions vs torch's upstream ones.

On synthetic multi-group graphs whose dp and tp FSDP all-gathers interleave (10^4, 4*10^4 and
10^5 nodes; quick mode: 10^4 only) it measures what FSDP pre-bucketing decides before merging:
``identify_fsdp_groups`` + the FSDP all-gather bucketing (``bucket_all_gather_by_mb`` with
torch's FSDP wait filter), once with torch's functions and once under ``patched(config)``.
Reports buckets formed and wall time (median of repeats), and the growth ratio
time(10^5)/time(10^4). A second table runs the whole ``OverlapBucketingPass`` (pre-bucketing +
overlap scheduling, CPU estimators, fake process group) on a synthetic backward-like graph and
reports ``max_consec_compute_between_rs`` before/after, with and without the span cap.

Run: ``uv run python -m benchmarks.bucketing [--quick]``.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from ap_bucketing import BucketingConfig, collect_stats, patched
from ap_testing.collectives import all_gather_bucketing_args, interleaved_fsdp_graph

from .bucketing_schedule import schedule_rows

SIZES_FULL = (10_000, 40_000, 100_000)
SIZES_QUICK = (10_000,)
CAP_MB = 64.0


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time; the cyclic GC is paused while timing (as ``timeit`` does), since its
    collections on 10^5-node graphs land on whichever run happens to allocate past a threshold."""
    fn()  # warm-up
    times = []
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    finally:
        if gc_was_enabled:
            gc.enable()
    return statistics.median(times)


def _prebucket_decision(gm: torch.fx.GraphModule) -> list[list[torch.fx.Node]]:
    """What ``pre_bucket_fsdp_collectives`` decides for all-gathers, without merging."""
    from torch._inductor.fx_passes import bucketing, fsdp

    groups, _size = fsdp.identify_fsdp_groups(gm)
    if not groups:
        return []
    result: list[list[torch.fx.Node]] = bucketing.bucket_all_gather_by_mb(
        gm, lambda _i: CAP_MB, filter_wait_node=fsdp.is_fsdp_all_gather_wait
    )
    return result


def _greedy_only(gm: torch.fx.GraphModule) -> list[list[torch.fx.Node]]:
    """torch's greedy bucketer alone (whatever is installed), all-gather filters, no FSDP
    wait filter: isolates the bucketing algorithm from torch's per-all-gather FSDP check."""
    from torch._inductor.fx_passes import bucketing

    result: list[list[torch.fx.Node]] = bucketing.greedy_bucket_collective_by_mb(
        *all_gather_bucketing_args(gm, CAP_MB)
    )
    return result


def _row(num_nodes: int, repeats: int) -> dict[str, Any]:
    gm = interleaved_fsdp_graph(num_nodes)
    config = BucketingConfig()
    upstream_buckets = _prebucket_decision(gm)
    upstream_s = _median_s(lambda: _prebucket_decision(gm), repeats)
    upstream_greedy_s = _median_s(lambda: _greedy_only(gm), repeats)
    with patched(config), collect_stats() as stats:
        patched_buckets = _prebucket_decision(gm)
        patched_s = _median_s(lambda: _prebucket_decision(gm), repeats)
        patched_greedy_s = _median_s(lambda: _greedy_only(gm), repeats)
    collectives = sum(1 for n in gm.graph.nodes if "all_gather" in str(n.target))
    return {
        "nodes": len(gm.graph.nodes),
        "collectives": collectives,
        "upstream_buckets": len(upstream_buckets),
        "patched_buckets": len(patched_buckets),
        "patched_bucketed": sum(len(b) for b in patched_buckets),
        "patched_max_span": stats[0].max_span if stats else 0,
        "upstream_ms": upstream_s * 1e3,
        "patched_ms": patched_s * 1e3,
        "ratio": patched_s / upstream_s,
        "upstream_greedy_ms": upstream_greedy_s * 1e3,
        "patched_greedy_ms": patched_greedy_s * 1e3,
        "greedy_ratio": patched_greedy_s / upstream_greedy_s,
    }


def run(quick: bool = False) -> dict[str, Any]:
    sizes = SIZES_QUICK if quick else SIZES_FULL
    repeats = 7
    rows = [_row(n, repeats) for n in sizes]
    result: dict[str, Any] = {
        "torch": torch.__version__,
        "cap_mb": CAP_MB,
        "max_topo_span": BucketingConfig().max_topo_span,
        "repeats": repeats,
        "rows": rows,
    }
    if len(rows) > 1:
        result["growth_upstream"] = rows[-1]["upstream_ms"] / rows[0]["upstream_ms"]
        result["growth_patched"] = rows[-1]["patched_ms"] / rows[0]["patched_ms"]
    result["schedule"] = schedule_rows(quick)
    return result


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"### Bucketing: patched vs upstream (torch {result['torch']}, cap {result['cap_mb']} MB,"
        f" max_topo_span {result['max_topo_span']}, median of {result['repeats']})",
        "",
        "| nodes | all-gathers | buckets upstream | buckets patched (collectives) | "
        "max span | upstream ms | patched ms | patched/upstream | "
        "greedy only: upstream ms | patched ms | ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['nodes']} | {r['collectives']} | {r['upstream_buckets']} | "
            f"{r['patched_buckets']} ({r['patched_bucketed']}) | {r['patched_max_span']} | "
            f"{r['upstream_ms']:.2f} | {r['patched_ms']:.2f} | {r['ratio']:.2f} | "
            f"{r['upstream_greedy_ms']:.2f} | {r['patched_greedy_ms']:.2f} | "
            f"{r['greedy_ratio']:.2f} |"
        )
    lines += [
        "",
        "Pass time = identify_fsdp_groups + FSDP all-gather bucketing decision (torch's FSDP wait"
        " filter included), as pre_bucket_fsdp_collectives runs them before merging. Greedy only"
        " = the bucketer alone with all-gather filters.",
    ]
    if "growth_patched" in result:
        lines += [
            "",
            f"time(largest)/time(smallest): upstream {result['growth_upstream']:.1f}x, "
            f"patched {result['growth_patched']:.1f}x (node ratio "
            f"{result['rows'][-1]['nodes'] / result['rows'][0]['nodes']:.1f}x)",
        ]
    schedule = result.get("schedule") or []
    if schedule:
        lines += [
            "",
            "### max_consec_compute_between_rs around OverlapBucketingPass (CPU, fake PG)",
            "",
            "| graph | max_topo_span | before | after | buckets | pass ms |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for s in schedule:
            lines.append(
                f"| {s['graph']} | {s['max_topo_span']} | {s['before']} | {s['after']} | "
                f"{s['buckets']} | {s['pass_ms']:.0f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    out = run(quick="--quick" in sys.argv)
    print(markdown(out))
    if "--json" in sys.argv:
        print(json.dumps(out, indent=2))
