"""Smoke test of the benchmark suite: ``--quick`` runs sections end to end and writes JSON with
their data. Timings are not asserted (they belong to the suite, not to tests). The default run
takes the three cheap sections; ``uv run pytest -m heavy`` runs all ten (~10 minutes on 2
cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = (
    "memory",
    "partitioner",
    "bucketing",
    "chunking",
    "e2e",
    "real_models",
    "real_models_compile",
    "projection",
    "kernels",
    "gpu",
)


#: Sections whose ``--quick`` run is minutes on 2 cores (five fresh compiles on two gloo ranks;
#: four codegen compiles of the model kit; the zoo's real models, and their compile times; the
#: partitioner's timing loops; the 8B projection's exact partitions; the GPU benchmark's six
#: worker processes, 114 s -- its runner is tested on its own in
#: ``tests/test_gpu_benchmark_workers.py``): only the ``heavy`` test runs them.
HEAVY = (
    "e2e",
    "kernels",
    "real_models",
    "real_models_compile",
    "partitioner",
    "projection",
    "gpu",
)
CHEAP = tuple(name for name in SECTIONS if name not in HEAVY)


def _quick_run(tmp_path: Path, sections: tuple[str, ...]) -> tuple[dict[str, Any], str, Path]:
    out = tmp_path / "bench.json"
    plots = tmp_path / "plots"
    only = [] if sections == SECTIONS else ["--only", *sections]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--json", str(out), "--plots", str(plots)]
        + only,
        cwd=ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=1800,  # each section compiles; minutes on a loaded 2-core machine
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["quick"] is True
    assert set(data["sections"]) == set(sections)
    for name in sections:
        assert "error" not in data["sections"][name], data["sections"][name]
    for number, name in enumerate(SECTIONS, start=1):  # the suite's section numbers
        assert (f"## {number}." in proc.stdout) == (name in sections), name
    return data["sections"], proc.stdout, plots


@pytest.mark.slow
def test_quick_run_writes_the_cheap_sections(tmp_path: Path) -> None:
    sections, _, plots = _quick_run(tmp_path, CHEAP)
    assert sections["memory"]["rows"] and sections["memory"]["rows"][0]["partitions"]["first"]
    assert sections["bucketing"]["rows"]
    assert sections["chunking"]["rows"]
    assert sorted(p.name for p in plots.glob("*.png")) == [
        "bucketing_time.png",
        "chunking_time.png",
    ]


@pytest.mark.heavy
def test_quick_run_writes_every_section(tmp_path: Path) -> None:
    sections, _, plots = _quick_run(tmp_path, SECTIONS)
    assert sections["partitioner"]["timing"] and sections["partitioner"]["memory"]
    assert {row["name"] for row in sections["e2e"]["rows"]} >= {"eager", "stock Inductor"}
    real = sections["real_models"]["rows"][0]["partitions"]
    assert real["replay_min_cut"]["runtime_bytes"] == real["replay_min_cut"]["bytes"]  # 2 measures
    assert sections["kernels"] and sections["projection"]
    _check_gpu_rows(sections["gpu"])
    assert sorted(p.name for p in plots.glob("*.png")) == [
        "bucketing_time.png",
        "chunking_time.png",
        "partitioner_time.png",
        "real_models_saved.png",
    ]


def _check_gpu_rows(result: dict[str, Any]) -> None:
    """The ``benchmarks.gpu`` section at its quick CPU shape (the same ``run`` as ``python -m
    benchmarks.gpu --device cpu --quick``): every row of the table, sane numbers, and the ap
    default saves no all-gather output and no more than plain ``torch.compile``, which saves
    them. Each row ran in a process of its own (not the runner's) with cache directories of
    its own, found empty: a row that shared another's process or caches fails here."""
    env = result["environment"]
    assert env["torch"] and result["world"] == 8
    (shape,) = result["shapes"]
    rows = shape["rows"]
    assert tuple(rows) == ("plain", "ap_default", "ap_budget")
    for key, row in rows.items():
        assert row["status"] == "ok", (key, row["status"])
        assert row["step_ms"] > 0 and row["compile_s"] > 0, key
        assert row["generated_kernels"] > 0 and row["kernels_per_step"] > 0, key
        assert row["kernel_ms"] > 0 and row["peak_bytes"] is None, key  # CPU: no peak
        assert row["gflops_per_step"] > 0, key  # the model's matmuls, counted from shapes
        assert row["saved_bytes"] >= 0 and row["saved_tensors"] >= 0, key
        assert [r["phase"] for r in row["runs"]] == ["cold"] and row["warm_runs"] == [], key
        assert row["cache"]["fxgraph_hit"] == 0 and row["cache"]["fxgraph_miss"] > 0, key
        assert row["inductor_cache_dir"].endswith(f"r1-{key}/inductor"), key
        assert row["triton_cache_dir"].endswith(f"r1-{key}/triton"), key
    pids = [row["pid"] for row in rows.values()]
    assert env["runner_pid"] not in pids and len(set(pids)) == len(rows), pids
    assert len({row["inductor_cache_dir"] for row in rows.values()}) == len(rows)
    plain, default = rows["plain"], rows["ap_default"]
    assert plain["saved_ag"] > 0 and default["saved_ag"] == 0
    assert 0 < default["saved_bytes"] <= plain["saved_bytes"]
    assert rows["ap_budget"]["budget_bytes"] == default["saved_bytes"] // 2
    assert rows["ap_budget"]["saved_bytes"] <= rows["ap_budget"]["budget_bytes"]
    # what the budget stops saving the backward recomputes: never fewer FLOPs than the default
    assert rows["ap_budget"]["gflops_per_step"] >= default["gflops_per_step"]
