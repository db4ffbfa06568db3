"""Smoke test of the benchmark suite: ``--quick`` runs every section end to end and writes JSON
with every section's data. Timings are not asserted (they belong to the suite, not to tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
        timeout=900,
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
    real = sections["real_models"]["rows"][0]["partitions"]
    assert real["replay_min_cut"]["runtime_bytes"] == real["replay_min_cut"]["bytes"]  # 2 measures
    for heading in ("## 1.", "## 2.", "## 3.", "## 4.", "## 5.", "## 6.", "## 7.", "## 8."):
        assert heading in proc.stdout
    assert sorted(p.name for p in plots.glob("*.png")) == [
        "bucketing_time.png",
        "chunking_time.png",
        "partitioner_time.png",
        "real_models_saved.png",
    ]
