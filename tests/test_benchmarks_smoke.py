"""Smoke test of the benchmark suite: ``--quick`` runs every section end to end and writes JSON
with every section's data. Timings are not asserted (they belong to the suite, not to tests)."""

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


@pytest.mark.slow
def test_quick_run_writes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    plots = tmp_path / "plots"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--json", str(out), "--plots", str(plots)],
        cwd=ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=1800,  # ten sections, each compiling; minutes on a loaded 2-core machine
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["quick"] is True
    assert set(data["sections"]) == set(SECTIONS)
    for name in SECTIONS:
        assert "error" not in data["sections"][name], data["sections"][name]
    sections = data["sections"]
    assert sections["memory"]["rows"] and sections["memory"]["rows"][0]["partitions"]["first"]
    assert sections["partitioner"]["timing"] and sections["partitioner"]["memory"]
    assert sections["bucketing"]["rows"]
    assert sections["chunking"]["rows"]
    assert {row["name"] for row in sections["e2e"]["rows"]} >= {"eager", "stock Inductor"}
    _check_gpu_rows(sections["gpu"])
    real = sections["real_models"]["rows"][0]["partitions"]
    assert real["replay_min_cut"]["runtime_bytes"] == real["replay_min_cut"]["bytes"]  # 2 measures
    for heading in (
        "## 1.",
        "## 2.",
        "## 3.",
        "## 4.",
        "## 5.",
        "## 6.",
        "## 7.",
        "## 8.",
        "## 9.",
        "## 10.",
    ):
        assert heading in proc.stdout
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
    them."""
    assert result["environment"]["torch"] and result["world"] == 8
    (shape,) = result["shapes"]
    rows = shape["rows"]
    assert tuple(rows) == ("plain", "plain_budget", "ap_default", "ap_full", "ap_budget")
    for key, row in rows.items():
        assert row["step_ms"] > 0 and row["compile_s"] > 0, key
        assert row["generated_kernels"] > 0 and row["kernels_per_step"] > 0, key
        assert row["kernel_ms"] > 0 and row["peak_bytes"] is None, key  # CPU: no peak
        assert row["saved_bytes"] >= 0 and row["saved_tensors"] >= 0, key
    plain, default = rows["plain"], rows["ap_default"]
    assert plain["saved_ag"] > 0 and default["saved_ag"] == 0
    assert 0 < default["saved_bytes"] <= plain["saved_bytes"]
    assert rows["ap_budget"]["budget_bytes"] == default["saved_bytes"] // 2
    assert rows["ap_budget"]["saved_bytes"] <= rows["ap_budget"]["budget_bytes"]
    assert rows["plain_budget"]["saved_bytes"] <= plain["saved_bytes"]
