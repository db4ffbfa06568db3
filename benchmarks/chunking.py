"""Chunk pass + concretization time vs joint-graph size (docs/architecture.md, "Chunking rules").

A stack of L residual MLP blocks (``ap_testing.chunking``) is traced once into a joint
forward+backward graph with a hinted unbacked token dim; each repeat chunks a fresh copy of that
graph (``layers.*``, 2 chunks) and concretizes it. Reported: joint-graph node counts before/after chunking, the median time of
``chunk_pass`` + ``concretize_chunk_symbols`` over the repeats, and time(L)/time(smallest L).

    uv run python -m benchmarks.chunking [--quick]
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from typing import Any

import torch
from ap_epchunk import (
    ChunkConfig,
    chunk_pass,
    concretize_chunk_symbols,
    mark_chunk_dim,
    trace_joint,
)
from ap_tags import annotate_module_fqns
from ap_testing.chunking import ResidualMLP, Stack, joint_step, module_state

D, TOKENS, REPEATS = 32, 64, 5


def _joint_graph(layers: int) -> torch.fx.GraphModule:
    model = Stack(D, layers, ResidualMLP)
    x = mark_chunk_dim(torch.randn(TOKENS, D, requires_grad=True), 0, hint=TOKENS)
    y = mark_chunk_dim(torch.randn(TOKENS, D), 0, hint=TOKENS)
    with annotate_module_fqns(model):
        return trace_joint(joint_step(model), module_state(model), x, y)


def _measure(layers: int) -> dict[str, Any]:
    gm = _joint_graph(layers)
    config = ChunkConfig(module_patterns=("layers.*",), num_chunks=2)
    times, after, regions = [], 0, 0
    for _ in range(REPEATS):
        work = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        work.meta.update(gm.meta)
        start = time.perf_counter()
        report = chunk_pass(work, config)
        concretize_chunk_symbols(work)
        times.append(time.perf_counter() - start)
        after, regions = len(work.graph.nodes), len(report.regions)
    return {
        "layers": layers,
        "nodes_before": len(gm.graph.nodes),
        "nodes_after": after,
        "regions": regions,
        "seconds": statistics.median(times),
    }


def run(quick: bool) -> dict[str, Any]:
    sizes = [8, 32] if quick else [8, 32, 128]
    rows = [_measure(n) for n in sizes]
    base = rows[0]["seconds"]
    for row in rows:
        row["ratio_vs_smallest"] = row["seconds"] / base
    return {"repeats": REPEATS, "num_chunks": 2, "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "### Chunk pass + concretize vs graph size (`layers.*`, 2 chunks, unbacked token dim)",
        "",
        "| layers | joint nodes before | nodes after | regions | median s | × smallest |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['layers']} | {r['nodes_before']} | {r['nodes_after']} | {r['regions']} | "
            f"{r['seconds']:.3f} | {r['ratio_vs_smallest']:.1f} |"
        )
    lines.append(
        f"\nmedian of {result['repeats']} repeats; goal: ×(128 vs 8) ≤ 20, 32 layers < 5 s"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(run(quick="--quick" in sys.argv)))
