"""The console script: --version, one-line errors, and the demo end to end (subprocess) whose
table agrees with its --json."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
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
            "1",  # what is checked is the table against the JSON, not a size
            "--json",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # without --verbose the output is the demo's own: progress lines and the table, none of
    # torch's per-rank INFO lines or no-CUDA warnings (issue 34)
    own = re.compile(r"(\[ap-backend demo\] |ap-backend demo: |\|)")
    foreign = [line for line in proc.stdout.splitlines() if line and not own.match(line)]
    assert foreign == [], foreign
    for text in ("pre_bucket_fsdp_collectives", "No CUDA runtime is found"):
        assert text not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert not re.search(r"^\[rank\d+\]:I", proc.stderr, re.M), proc.stderr[-3000:]
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
        ("first_partition", "first partition (min_cut_fusible)"),
        ("save_all", "SaveAll (backend)"),
        ("min_cut_ac", "min-cut + AC"),
        ("min_cut_ac_untagged", "min-cut + AC, no first compile"),
        ("plain_compile", "plain torch.compile (min-cut)"),
    ]:
        count, nbytes = re.fullmatch(
            r"(\d+) \(([\d,]+) B\)", _table_value(table, f"saved activations: {label}")
        ).groups()  # type: ignore[union-attr]
        assert int(count) == data["saved"][key]["count"]
        assert int(nbytes.replace(",", "")) == data["saved"][key]["bytes"]
    ag = _table_value(
        table, "all-gather outputs saved (first / SaveAll / min-cut+AC / untagged / plain)"
    )
    assert [int(x) for x in ag.split(" / ")] == [
        data["saved"][k]["all_gather_outputs_saved"]
        for k in (
            "first_partition",
            "save_all",
            "min_cut_ac",
            "min_cut_ac_untagged",
            "plain_compile",
        )
    ]
    assert data["saved"]["save_all"]["all_gather_outputs_saved"] == 0
    assert int(_table_value(table, "buckets formed (fw + bw)")) == data["buckets_formed"]
    # The AC pass in the second compile may only *add* stage-boundary saves to the replay.
    assert data["saved"]["save_all"]["count"] >= data["saved"]["first_partition"]["count"]
    assert data["mismatches"] == 0


def test_json_directory_is_checked_before_any_rank_starts(tmp_path: Path) -> None:
    out = _cli("demo", "--json", "/nonexistent/dir/x.json")
    assert out.returncode == 2
    assert out.stderr == (
        "ap-backend: error: argument --json: directory '/nonexistent/dir' does not exist\n"
    )
    # it used to run the whole demo first: nothing is printed before the error (no progress
    # line, no table). Not a time bound: importing torch alone takes 20 s on a loaded machine
    assert out.stdout == ""
    out = _cli("demo", "--json", str(tmp_path))
    assert out.returncode == 2 and "is a directory" in out.stderr


def _children(pid: int) -> list[int]:
    """Live descendants of ``pid`` (from /proc; zombies count as gone)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":
            parents[int(entry.name)] = int(fields[1])
    found: list[int] = []
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        found += kids
        frontier += kids
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize(
    ("how", "status", "word"),
    [
        ("sigint_parent", 130, "interrupted (Ctrl-C)"),
        ("sigint_group", 130, "interrupted (Ctrl-C)"),
        ("sigterm_parent", 143, "terminated (SIGTERM)"),
    ],
)
def test_interrupt_stops_every_rank_with_one_line(how: str, status: int, word: str) -> None:
    """Ctrl-C (the whole process group, as a terminal sends it, or the parent alone) and
    SIGTERM stop the demo within seconds: exit 130/143, one line, no traceback, no rank left
    compiling."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ap_backend.cli", "demo", "--layers", "1", "--steps", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
        # As a terminal starts a foreground job: SIGINT at its default. A shell without job
        # control starts background jobs (a CI script run with ``&``) with SIGINT ignored, the
        # demo inherits that through pytest, and an ignored Ctrl-C rightly stops nothing.
        preexec_fn=_sigint_default,
    )
    try:
        deadline = time.monotonic() + 120
        ranks: list[int] = []
        while len(ranks) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
            ranks = _children(proc.pid)
        assert len(ranks) >= 2, "the ranks never started"
        time.sleep(8)  # the ranks are importing torch / tracing by now
        ranks = _children(proc.pid)
        sent = time.monotonic()
        if how == "sigint_group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT if how == "sigint_parent" else signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        elapsed = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == status, err
    assert elapsed < 10, elapsed
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    ours = [line for line in err.splitlines() if line.startswith("ap-backend demo:")]
    assert ours == [f"ap-backend demo: {word}, all ranks stopped"], err
    time.sleep(1)
    assert [p for p in ranks if _alive(p)] == []
