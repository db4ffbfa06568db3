"""Section 1: activation memory saved for backward, on ap-backend's FSDP-style LLaMA kit.

For 2, 4 and 8 layers (fake process group, world size 8, capture-only partitions: AOTAutograd
with identity compilers, no codegen) this measures what each partition keeps alive for the
backward, counted by distinct storage (a view counts as its base) so every partitioner is
measured the same way:

(a) the first partition (torch's ``default_partition`` inside ``precompile``, FSDP tags on);
(b) ``SaveAllPartitioner`` in the second compile with the AC joint pass on;
(c) min-cut in the second compile with the AC joint pass on;
(d) min-cut in the second compile without AC;
(e) for contrast, min-cut + AC on the plain model with no first compilation (no FSDP tags):
    what stock Inductor would keep.

The goal is (b) == (a) exactly and 0 all-gather bytes saved by (b). The fake PG's data is
garbage, so only structure is measured, never values.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import torch
from ap_backend import measure_saved, precompile
from ap_backend.models import ModelConfig, Sharding, Transformer
from ap_partitioner import MinCutPartitioner, PartitionReport, SaveAllPartitioner
from ap_testing.distributed import fake_world

from benchmarks import markdown_table

STAGE_GIB = "auto"


def _measure(layers: int) -> dict[str, Any]:
    torch.compiler.reset()
    model = Transformer(ModelConfig(n_layers=layers, attention="matmul"), Sharding.from_world())
    batch = model.example_batch(0, 0)
    pm = precompile(model, batch)
    first = pm.first_partition
    rows: dict[str, Any] = {
        "first": {
            "count": first.count,
            "bytes": first.nbytes,
            "all_gather_saved": len(first.all_gather_outputs),
            "all_gather_bytes": 0,
        },
    }
    cases = (
        ("save_all_ac", pm, SaveAllPartitioner, True),
        ("min_cut_ac", pm, MinCutPartitioner, True),
        ("min_cut_no_ac", pm, MinCutPartitioner, False),
        ("untagged_min_cut_ac", model, MinCutPartitioner, True),
    )
    same_as_first = False
    for name, module, cls, ac in cases:
        reports: list[PartitionReport] = []
        torch.compiler.reset()
        summary = measure_saved(
            module,
            batch,
            partitioner=cls(on_report=reports.append),
            enable_ac=ac,
            ac_stage_size_gib=STAGE_GIB,
        )
        report = reports[-1]
        rows[name] = {
            "count": summary.count,
            "bytes": summary.nbytes,
            "all_gather_saved": len(summary.all_gather_outputs),
            "all_gather_bytes": report.saved_all_gather_bytes,
            "backward_collectives": report.backward_collectives,
            "fell_back": report.fell_back,
        }
        if name == "save_all_ac":
            same_as_first = Counter(summary.signatures) == Counter(first.signatures)
    b, c = rows["save_all_ac"], rows["min_cut_ac"]
    return {
        "layers": layers,
        "partitions": rows,
        "save_all_equals_first": same_as_first and b["bytes"] == rows["first"]["bytes"],
        "min_cut_ac_over_save_all_bytes": (c["bytes"] / b["bytes"]) if b["bytes"] else None,
    }


def run(quick: bool) -> dict[str, Any]:
    sizes = [2] if quick else [2, 4, 8]
    with fake_world():  # world size 8, structure only
        return {"rows": [_measure(n) for n in sizes], "ac_stage_size_gib": STAGE_GIB}


_LABELS = (
    ("first", "(a) first partition"),
    ("save_all_ac", "(b) SaveAll + AC"),
    ("min_cut_ac", "(c) min-cut + AC"),
    ("min_cut_no_ac", "(d) min-cut, no AC"),
    ("untagged_min_cut_ac", "(e) min-cut + AC, no first compile"),
)


_COLUMNS = (
    ("layers", "r"),
    ("partition", "l"),
    ("saved tensors", "r"),
    ("saved bytes", "r"),
    ("all-gather outputs saved", "r"),
    ("all-gather bytes", "r"),
    ("bw collectives", "r"),
)


def _partition_rows(result: dict[str, Any]) -> list[list[object]]:
    rows: list[list[object]] = []
    for row in result["rows"]:
        for key, label in _LABELS:
            p = row["partitions"][key]
            fb = " (fell back)" if p.get("fell_back") else ""
            rows.append(
                [
                    row["layers"],
                    f"{label}{fb}",
                    p["count"],
                    f"{p['bytes']:,}",
                    p["all_gather_saved"],
                    f"{p['all_gather_bytes']:,}",
                    p.get("backward_collectives", "–"),
                ]
            )
    return rows


def _verdict(row: dict[str, Any]) -> str:
    ratio = row["min_cut_ac_over_save_all_bytes"]
    same = "yes" if row["save_all_equals_first"] else "no"
    shown = "n/a" if ratio is None else f"{ratio:.2f}"
    return f"- {row['layers']} layers: (b) equals (a) exactly: **{same}**; (c)/(b) saved bytes = {shown}"


def markdown(result: dict[str, Any]) -> str:
    verdicts = [_verdict(row) for row in result["rows"]]
    return "\n".join([markdown_table(_COLUMNS, _partition_rows(result)), "", *verdicts])


if __name__ == "__main__":
    print(markdown(run(quick="--quick" in sys.argv)))
