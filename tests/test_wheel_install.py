"""Installing only ap-backend's wheel (built with ``uv build``) into a fresh venv pulls in the
four other packages from sibling wheels, and ``ap-backend --version`` works. Reuses the uv
cache (torch is not downloaded again when cached)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ap-tags", "ap-partitioner", "ap-bucketing", "ap-epchunk", "ap-backend")


def _source_version(name: str) -> str:
    """The version as written in the package's ``_version.py`` (its one source)."""
    text = (ROOT / "packages" / name / "src" / name.replace("-", "_") / "_version.py").read_text()
    found = re.search(r"""^__version__ = ["']([^"']+)["']""", text, re.M)
    assert found, name
    return found[1]


def _run(*cmd: str, cwd: Path = ROOT, timeout: float = 600) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc.stdout


@pytest.mark.slow
def test_backend_wheel_pulls_in_siblings(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    for name in PACKAGES:
        _run("uv", "build", "--wheel", "--out-dir", str(dist), str(ROOT / "packages" / name))
    wheels = sorted(p.name for p in dist.glob("*.whl"))
    assert len(wheels) == 5, wheels
    venv = tmp_path / "venv"
    _run("uv", "venv", "--python", "3.11", str(venv))
    backend_wheel = next(dist.glob("ap_backend-*.whl"))
    _run(
        "uv",
        "pip",
        "install",
        "--python",
        str(venv / "bin" / "python"),
        "--find-links",
        str(dist),
        str(backend_wheel),
        "torch==2.15.0",
    )
    frozen = _run("uv", "pip", "freeze", "--python", str(venv / "bin" / "python"))
    for name in PACKAGES[:-1]:  # pulled in as dependencies, from the sibling wheels
        assert f"{name}=={_source_version(name)}" in frozen, frozen
    backend = f"ap_backend-{_source_version('ap-backend')}"
    assert "ap-backend @ file://" in frozen and backend in frozen, frozen
    out = _run(str(venv / "bin" / "ap-backend"), "--version", cwd=tmp_path)
    for name in (*PACKAGES, "torch"):
        assert f"{name} " in out, out
