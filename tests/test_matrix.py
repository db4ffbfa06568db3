"""``scripts/matrix <package> nightly`` installs the nightly torch first, then the packages with
normal dependency resolution (no ``--no-deps``) pinned to that nightly; a real ``uv pip install``
accepts an installed ``2.16.0.devN`` for the packages' ``torch>=2.13``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
NIGHTLY = "2.16.0.dev20261101"


def _editables(args: list[str]) -> set[str]:
    return {Path(args[i + 1]).name for i, a in enumerate(args) if a == "-e"}


def test_install_arguments(matrix_script: ModuleType) -> None:
    assert matrix_script.torch_first("2.15.0") == []
    first = matrix_script.torch_first("nightly")
    assert first[:2] == ["--pre", "torch"] and matrix_script.NIGHTLY_INDEX in first
    args = matrix_script.package_install("ap-partitioner", f"torch=={NIGHTLY}+cpu")
    assert args[0] == f"torch=={NIGHTLY}+cpu" and "--no-deps" not in args
    assert _editables(args) == {"ap-tags", "ap-partitioner", "ap-testing"}
    assert _editables(matrix_script.package_install("ap-bucketing", "torch==2.15.0")) == {
        "ap-bucketing",
        "ap-testing",
    }


def test_nightly_installs_torch_first_then_resolves_the_packages_against_it(
    matrix_script: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    commands: list[list[str]] = []
    monkeypatch.setattr(matrix_script, "uv", lambda: "uv")
    monkeypatch.setattr(matrix_script, "run", lambda cmd, **kw: commands.append(cmd))
    monkeypatch.setattr(matrix_script, "installed_torch", lambda py: f"{NIGHTLY}+cpu")

    def pytest_run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        assert cmd[1:3] == ["-m", "pytest"], cmd
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(matrix_script.subprocess, "run", pytest_run)
    assert matrix_script.main(["matrix", "ap-bucketing", "nightly"]) == 0
    venv, torch, packages = commands
    assert venv[:2] == ["uv", "venv"]
    assert torch[:3] == ["uv", "pip", "install"] and matrix_script.NIGHTLY_INDEX in torch
    assert packages[:3] == ["uv", "pip", "install"] and "--no-deps" not in packages
    assert f"torch=={NIGHTLY}+cpu" in packages and "--index-url" not in packages
    assert _editables(packages) == {"ap-bucketing", "ap-testing"}
    assert f"ap-bucketing on torch {NIGHTLY}+cpu: PASS" in capsys.readouterr().out


def _fake_torch_wheel(directory: Path, version: str) -> Path:
    """A wheel named torch (one empty module) standing in for a nightly: installing it needs no
    index, and nothing here imports it."""
    info = f"torch-{version}.dist-info"
    files = {
        "torch/__init__.py": f"__version__ = {version!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    wheel = directory / f"torch-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


@pytest.mark.slow
@pytest.mark.parametrize("package", ["ap-bucketing", "ap-partitioner"])
def test_uv_resolves_the_packages_next_to_an_installed_nightly(
    matrix_script: ModuleType, tmp_path: Path, package: str
) -> None:
    uv = shutil.which("uv")
    assert uv is not None
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    py = str(venv / "bin" / "python")
    pip = [uv, "pip", "install", "-q", "--python", py]
    subprocess.run([*pip, str(_fake_torch_wheel(tmp_path, NIGHTLY))], check=True)
    proc = subprocess.run(
        [*pip, *matrix_script.package_install(package, f"torch=={NIGHTLY}")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    listed = subprocess.run(
        [uv, "pip", "list", "--format", "json", "--python", py],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    versions = {d["name"]: d["version"] for d in json.loads(listed)}
    assert versions["torch"] == NIGHTLY, versions  # kept, not replaced by a stable torch
    assert package in versions and "ap-testing" in versions, versions
