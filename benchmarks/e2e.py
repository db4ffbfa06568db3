"""End to end on the demo model: compile time and steady-state step time of
``autoparallel_backend`` (two-stage: precompile + backend) vs stock Inductor vs eager, on 2
gloo ranks. Compile time = first step (which compiles the forward and, lazily, the backward)
minus the median steady step, plus precompile for the two-stage path. Step times: median of
>= 5 steps after the first (quick: 2), rank 0.

Sized so activations dominate (issue 35): sequence 1024, batch 2 (2,048 tokens per rank), the
demo width (dim 64) and 2 layers, so both gloo ranks still finish in minutes on a 2-core CPU.
Rows: eager, stock Inductor (plain ``torch.compile``), tagged min-cut (``partitioner=
"min_cut"`` on ``precompile``'s output), the ap default (the replay of the min-cut first
partition), the same with AC (in both compilations) and the full configuration. The replay of a
``default_partition`` first partition is in the saved-bytes tables (sections 6 and 8) only: the
demo's ``Variant`` has no ``first_partition`` option.

Every configuration is first compiled once as a discarded warm-up round (full run only), so
each measured compile meets the same warm state (C++ toolchain loaded, kernel ``.so`` files
cached; the FX-graph and AOTAutograd caches stay off). Without it the configuration that
happens to run first pays the one-off C++ start-up cost and the ratios are meaningless.

    uv run python -m benchmarks.e2e
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from ap_backend.demo import TrainSpec, Variant, run_rank, spawn_ranks
from ap_backend.models import ModelConfig

from benchmarks import markdown_table

SEQ = 1024
SEQ_QUICK = 16
VARIANTS = (
    Variant("stock Inductor", backend="inductor"),
    Variant("tagged min-cut", {"partitioner": "min_cut"}),
    Variant("autoparallel_backend", {"enable_ac": False}),
    Variant("autoparallel_backend + AC", {"enable_ac": True}, first_compile_ac=True),
    Variant(
        "autoparallel_backend (AC + bucketing + overlap)",
        {"enable_ac": True, "bucketing": True, "overlap_scheduling": True},
    ),
)


def run(quick: bool) -> dict[str, Any]:
    layers = 1 if quick else 2
    steps = 3 if quick else 6  # first step compiles; the median is over the others
    warm_up = () if quick else tuple(replace(v, name=f"warm-up: {v.name}") for v in VARIANTS)
    spec = TrainSpec(
        model=ModelConfig(
            n_layers=layers, seq_len=SEQ_QUICK if quick else SEQ, batch=2, attention="matmul"
        ),
        variants=(*warm_up, *VARIANTS),
        steps=steps,
    )
    ranks = spawn_ranks(run_rank, 2, spec)
    r0 = ranks[0]
    rows: list[dict[str, Any]] = [
        {"name": "eager", "compile_s": 0.0, "step_s": r0["eager"]["step_s"], "mismatches": 0}
    ]
    for v in VARIANTS:
        out = r0["variants"][v.name]
        compile_s = out["first_step_s"] - out["step_s"] + out.get("precompile_s", 0.0)
        rows.append(
            {
                "name": v.name,
                "compile_s": compile_s,
                "precompile_s": out.get("precompile_s", 0.0),
                "first_step_s": out["first_step_s"],
                "step_s": out["step_s"],
                "mismatches": sum(len(r["variants"][v.name]["mismatches"]) for r in ranks),
            }
        )
    seq = SEQ_QUICK if quick else SEQ
    return {"layers": layers, "seq": seq, "batch": 2, "ranks": 2, "steps": steps, "rows": rows}


_COLUMNS = (
    ("configuration", "l"),
    ("compile time (s)", "r"),
    ("of which precompile (s)", "r"),
    ("steady step (ms)", "r"),
    ("grad/loss mismatches vs eager", "r"),
)


def markdown(result: dict[str, Any]) -> str:
    rows = [
        [
            row["name"],
            f"{row['compile_s']:.2f}",
            f"{row.get('precompile_s', 0.0):.2f}",
            f"{row['step_s'] * 1e3:.1f}",
            row["mismatches"],
        ]
        for row in result["rows"]
    ]
    heading = (
        f"Demo model, {result['layers']} layers, seq {result.get('seq')}, batch "
        f"{result.get('batch')}, {result['ranks']} gloo ranks, median of "
        f"{result['steps'] - 1} steady steps (rank 0)."
    )
    return f"{heading}\n\n{markdown_table(_COLUMNS, rows)}"


if __name__ == "__main__":
    print(markdown(run(quick="--quick" in sys.argv)))
