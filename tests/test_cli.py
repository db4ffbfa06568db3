"""The console script: --version, one-line errors, and the demo end to end (subprocess) whose
table agrees with its --json."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ap_backend.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_version_lists_all_five_packages_and_torch() -> None:
    out = _cli("--version")
    assert out.returncode == 0, out.stderr
    for name in ("ap-tags", "ap-partitioner", "ap-bucketing", "ap-epchunk", "ap-backend", "torch"):
        assert re.search(rf"^{name} \d", out.stdout, re.M), out.stdout


def test_bad_option_exits_2_with_one_line() -> None:
    """End to end through the interpreter; the parser cases are unit-tested in the package."""
    out = _cli("demo", "--layers", "0")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "error" in out.stderr, out.stderr


def _table_value(table: str, label: str) -> str:
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0] == label:
            return cells[1]
    raise AssertionError(f"row {label!r} not in table:\n{table}")


@pytest.mark.slow
@pytest.mark.multirank
def test_demo_subprocess_table_agrees_with_json(tmp_path: Path) -> None:
    out_json = tmp_path / "demo.json"
    proc = subprocess.run(
        [
            "uv",
            "run",
            "ap-backend",
            "demo",
            "--steps",
            "2",
            "--layers",
            "2",
            "--json",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out_json.read_text())
    table = proc.stdout
    assert len(data["steps"]) == 2
    for st in data["steps"]:
        eager, compiled = _table_value(table, f"step {st['step']} loss eager / compiled").split(
            " / "
        )
        assert float(eager) == pytest.approx(st["loss_eager"], abs=1e-6)
        assert float(compiled) == pytest.approx(st["loss_compiled"], abs=1e-6)
    for key, label in [
        ("first_partition", "first partition (default)"),
        ("save_all", "SaveAll (backend)"),
        ("min_cut_ac", "min-cut + AC"),
        ("min_cut_ac_untagged", "min-cut + AC, no first compile"),
    ]:
        count, nbytes = re.fullmatch(
            r"(\d+) \(([\d,]+) B\)", _table_value(table, f"saved activations: {label}")
        ).groups()  # type: ignore[union-attr]
        assert int(count) == data["saved"][key]["count"]
        assert int(nbytes.replace(",", "")) == data["saved"][key]["bytes"]
    ag = _table_value(table, "all-gather outputs saved (first / SaveAll / min-cut+AC / untagged)")
    assert [int(x) for x in ag.split(" / ")] == [
        data["saved"][k]["all_gather_outputs_saved"]
        for k in ("first_partition", "save_all", "min_cut_ac", "min_cut_ac_untagged")
    ]
    assert data["saved"]["save_all"]["all_gather_outputs_saved"] == 0
    assert int(_table_value(table, "buckets formed (fw + bw)")) == data["buckets_formed"]
    # The AC pass in the second compile may only *add* stage-boundary saves to the replay.
    assert data["saved"]["save_all"]["count"] >= data["saved"]["first_partition"]["count"]
    assert data["mismatches"] == 0
