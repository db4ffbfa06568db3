"""Partitioner benchmark: SaveAll vs min-cut, time and activation memory.

Time: wall time of one partitioner call on the same second-compile joint graph (AC joint pass
on, as in production) for 4/8/16/32-layer FSDP-style transformers (quick: 4, 8); median of
repeats, each on a fresh deep copy (partitioners mutate their input), after one warm-up call
(the first call pays torch's lazy imports).

Memory: bytes of activations the forward keeps for the backward, bytes of those that are
all-gather outputs (unsharded weights), and the collectives the backward runs, for the first
partition vs SaveAll+AC vs min-cut+AC vs min-cut without AC, on 2/4/8 layers. Measured by
``PartitionReport`` on the fake process group (structure only). Runs with
``uv run python -m benchmarks.partitioner [--quick]``.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from ap_partitioner import MinCutPartitioner, PartitionReport, SaveAllPartitioner

from benchmarks.partitioner_model import (
    CapturedJoint,
    fake_process_group,
    first_compile,
    second_compile,
)

REPEATS = 5


def _time_partitioner(make: Any, joint: CapturedJoint, repeats: int) -> list[float]:
    make()(joint.fresh(), [], **joint.kwargs)  # warm-up
    times = []
    for _ in range(repeats):
        gm = joint.fresh()
        part = make()
        start = time.perf_counter()
        part(gm, [], **joint.kwargs)
        times.append(time.perf_counter() - start)
    return times


def _timing(layers: list[int], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for n in layers:
        first = first_compile(n)
        captured: list[CapturedJoint] = []
        second_compile(first, MinCutPartitioner(), ac=True, capture=captured)
        joint = captured[0]
        save_all = _time_partitioner(SaveAllPartitioner, joint, repeats)
        min_cut = _time_partitioner(MinCutPartitioner, joint, repeats)
        rows.append({
            "layers": n,
            "joint_nodes": len(joint.gm.graph.nodes),
            "save_all_ms": statistics.median(save_all) * 1e3,
            "min_cut_ms": statistics.median(min_cut) * 1e3,
            "save_all_runs_ms": [t * 1e3 for t in save_all],
            "min_cut_runs_ms": [t * 1e3 for t in min_cut],
        })
    return rows


def _row(name: str, r: PartitionReport) -> dict[str, Any]:
    return {
        "partition": name,
        "saved_activations": r.saved_activation_count,
        "activation_bytes": r.saved_activation_bytes,
        "all_gather_saved": r.saved_all_gather_count,
        "all_gather_bytes": r.saved_all_gather_bytes,
        "bw_collectives": r.backward_collectives,
        "bw_all_gathers": r.backward_all_gathers,
        "fell_back": r.fell_back,
    }


def _memory(layers: list[int]) -> list[dict[str, Any]]:
    rows = []
    for n in layers:
        first = first_compile(n)
        got: dict[str, PartitionReport] = {}
        for name, part, ac in (
            ("save_all+ac", SaveAllPartitioner(), True),
            ("min_cut+ac", MinCutPartitioner(), True),
            ("min_cut", MinCutPartitioner(), False),
        ):
            reports: list[PartitionReport] = []
            part.on_report = reports.append
            second_compile(first, part, ac=ac)
            got[name] = reports[0]
        for name, rep in (("first", first.report), *got.items()):
            rows.append({"layers": n, **_row(name, rep)})
    return rows


def run(quick: bool) -> dict[str, Any]:
    with fake_process_group():
        timing = _timing([4, 8] if quick else [4, 8, 16, 32], REPEATS)
        memory = _memory([2, 4] if quick else [2, 4, 8])
    return {"repeats": REPEATS, "timing": timing, "memory": memory}


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"Partitioner wall time (median of {result['repeats']}, AC joint pass on, one call "
        "on the same joint graph):",
        "",
        "| layers | joint nodes | SaveAll ms | min-cut ms | SaveAll / min-cut |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in result["timing"]:
        ratio = r["save_all_ms"] / r["min_cut_ms"] if r["min_cut_ms"] else float("nan")
        lines.append(f"| {r['layers']} | {r['joint_nodes']} | {r['save_all_ms']:.1f} | "
                     f"{r['min_cut_ms']:.1f} | {ratio:.2f} |")
    lines += [
        "",
        "Saved for backward (fake PG, world size 8; bytes from fake tensor sizes). The first "
        "partition runs no CSE, so it saves the identical `y.view(...)` feeding q, k and v three "
        "times; the replay's CSE merges them into one saved value (same values, fewer "
        "duplicates).",
        "",
        "| layers | partition | saved activations | activation bytes | all-gather outputs "
        "saved | all-gather bytes | bw collectives | bw all-gathers |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["memory"]:
        fb = " (fell back)" if r["fell_back"] else ""
        lines.append(
            f"| {r['layers']} | {r['partition']}{fb} | {r['saved_activations']} | "
            f"{r['activation_bytes']} | {r['all_gather_saved']} | {r['all_gather_bytes']} | "
            f"{r['bw_collectives']} | {r['bw_all_gathers']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(run(quick="--quick" in sys.argv)))
