"""``benchmarks.gpu``'s runner on CPU (issue 42, item 6): a row's warm run is a new process on
the caches its cold run filled (``heavy``: ``uv run pytest -m heavy``), and the time budget
skips or stops workers while the table and the JSON still come out. The cold rows' own
processes and caches are checked in every run by the benchmark smoke test
(``tests/test_benchmarks_smoke.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.heavy  # a cold compile (~40-70 s on 2 cores) beside the smoke test's three
def test_warm_run_is_a_new_process_on_the_rows_own_filled_caches(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--device", "cpu", "--quick"]
        + ["--rows", "plain", "--warm", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    row = result["shapes"][0]["rows"]["plain"]
    (cold,) = row["runs"]
    (warm,) = row["warm_runs"]
    assert cold["status"] == warm["status"] == "ok", (cold["status"], warm["status"])
    assert (cold["phase"], warm["phase"]) == ("cold", "warm")
    pids = {cold["pid"], warm["pid"], result["environment"]["runner_pid"]}
    assert len(pids) == 3, pids
    assert warm["inductor_cache_dir"] == cold["inductor_cache_dir"]
    assert warm["triton_cache_dir"] == cold["triton_cache_dir"]
    assert cold["cache"]["fxgraph_hit"] == 0 and cold["cache"]["fxgraph_miss"] > 0
    assert warm["cache"]["fxgraph_hit"] > 0 and warm["cache"]["fxgraph_miss"] == 0
    assert warm["compile_s"] < cold["compile_s"]
    assert "| plain `torch.compile` |" in proc.stdout and "warm first step s" in proc.stdout
    assert not Path(cold["inductor_cache_dir"]).exists()  # the run's temp root is removed


def test_budget_stops_the_running_worker_and_skips_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import gpu

    out = tmp_path / "gpu.json"
    plan = gpu.plan_for("cpu", quick=True, rows=("plain", "ap_default"), budget_s=None)
    # the first worker has nothing to be estimated from, so it starts, and is stopped at the
    # deadline (a cold compile takes far longer than these seconds); the second does not start
    result = gpu.execute(plan, deadline=time.time() + gpu.RESERVE_S + 4, json_path=out)
    rows = result["shapes"][0]["rows"]
    first, second = rows["plain"], rows["ap_default"]
    assert first["status"].startswith("stopped: budget"), first["status"]
    assert second["status"].startswith("not run: budget"), second["status"]
    assert result["workers"] == {"ok": 0, "not_run": 2, "failed": 0}
    with pytest.raises(ProcessLookupError):  # the stopped worker is gone
        os.kill(first["runs"][0]["pid"], 0)
    assert json.loads(out.read_text())["workers"] == result["workers"]
    table = gpu.markdown(result)
    assert "stopped: budget" in table and "not run: budget" in table
