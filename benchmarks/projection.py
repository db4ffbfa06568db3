"""Section 8: saved all-gather bytes at the seeds' scale (LLaMA-3 8B, FSDP on 128 ranks, bf16).

No hand arithmetic: torchtitan's own 8B model config (dim 4096, 32 q / 8 kv heads, FFN 14336,
fused QKV) is built with its first 1 and then 2 transformer layers (vocabulary cut to 256, so
the embedding and head stay small; they are not per-layer), cast to bf16 (FSDP's bf16
parameter all-gather), wrapped in the zoo's ``FsdpTrainStep`` on a fake process group of world
size 128, and partitioned for real (graph and run-time measures of
:func:`benchmarks.real_models.measure_step`, one definition of "saved":
``ap_tags.graph.activation_storages`` through ``PartitionReport``). The per-layer figure is the
2-layer count minus the 1-layer count (embedding, head and loss cancel), scaled to 4 and 32
layers. Activations are at sequence 16, batch 2 (all-gather bytes do not depend on them).

    uv run python -m benchmarks.projection
"""

from __future__ import annotations

import sys
from typing import Any, cast

import torch
from ap_partitioner import MinCutPartitioner
from ap_testing.distributed import fake_world
from torch import nn

from benchmarks import markdown_table
from benchmarks.real_models import PARTITIONS, build_step, measure_step

WORLD = 128
LAYERS = (1, 2)
SEQ = 16
#: The seeds' headline: ~1.2 GB of extra activations per 4 layers from saved all-gathers.
SEEDS_CLAIM_PER_4_LAYERS = 1.2e9
PROJECTION_PARTITIONS = (
    *PARTITIONS,
    ("untagged_min_cut_ac", "(f) min-cut + AC, no first compile", MinCutPartitioner, True, False),
)


def _measure(n_layers: int) -> dict[str, Any]:
    torch.compiler.reset()
    step, batch = build_step(
        "tt_llama3_8b", {"n_layers": n_layers, "seq": SEQ}, dtype=torch.bfloat16
    )
    model: nn.Module = cast(Any, step).model  # FsdpTrainStep's unsharded model
    full_params = sum(p.numel() for p in model.parameters())
    rows = measure_step(step, batch, PROJECTION_PARTITIONS)
    return {"layers": n_layers, "full_params": full_params, "partitions": rows}


def run(quick: bool) -> dict[str, Any]:
    if quick:
        return {"skipped": "8B-shaped layers: full run only (about 2 GB of bf16 weights)"}
    with fake_world(WORLD):
        one, two = (_measure(n) for n in LAYERS)
    per_layer: dict[str, dict[str, int]] = {}
    for key in ("first", *(k for k, *_ in PROJECTION_PARTITIONS)):
        a, b = one["partitions"][key], two["partitions"][key]
        per_layer[key] = {
            field: (b.get(field) or 0) - (a.get(field) or 0)
            for field in ("all_gather_count", "all_gather_bytes", "bytes", "runtime_bytes")
        }
    return {
        "world": WORLD,
        "seq": SEQ,
        "rows": [one, two],
        "per_layer": per_layer,
        "params_per_layer": two["full_params"] - one["full_params"],
    }


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB"


def markdown(result: dict[str, Any]) -> str:
    if "skipped" in result:
        return f"skipped: {result['skipped']}"
    labels = (("first", "(a) first partition"), *((k, lbl) for k, lbl, *_ in PROJECTION_PARTITIONS))
    rows = []
    for key, label in labels:
        p = result["per_layer"][key]
        ag = p["all_gather_bytes"]
        rows.append(
            [
                label,
                p["all_gather_count"],
                _gb(ag),
                _gb(4 * ag),
                _gb(32 * ag),
                f"{4 * ag / SEEDS_CLAIM_PER_4_LAYERS:.2f}",
            ]
        )
    columns = (
        ("partition", "l"),
        ("all-gather outputs saved per layer", "r"),
        ("saved all-gather bytes per layer", "r"),
        ("per 4 layers", "r"),
        ("32 layers", "r"),
        ("per 4 layers / seeds' 1.2 GB", "r"),
    )
    head = (
        f"LLaMA-3 8B layer shapes (torchtitan `_8b` config; {result['params_per_layer']:,} "
        f"parameters per layer), bf16, FSDP world {result['world']} (fake PG), per layer = "
        "2-layer minus 1-layer count, measured by `PartitionReport.saved_all_gather_bytes`:"
    )
    return f"{head}\n\n{markdown_table(columns, rows)}"


if __name__ == "__main__":
    print(markdown(run(quick="--quick" in sys.argv)))
