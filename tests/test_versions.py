"""Separately versioned packages: one version source each, a torch requirement that admits the
next torch's nightlies, and sibling requirements with compatible-release bounds.

* Each published package writes its version once, in ``src/<module>/_version.py`` (hatch's
  dynamic version); the installed metadata and ``<module>.__version__`` read it back.
* Each torch requirement admits every tested version and ``2.16.0.dev20261101`` (a nightly of
  the next release, which ``<2.16`` excluded) as an installer treats an installed pre-release,
  with the floor at the oldest tested version.
* Each requirement on a sibling carries a lower and an upper bound (``ap-tags>=0.1,<0.2``), and
  the bound admits the sibling's workspace version: bumping ap-tags to 0.2.0 without widening
  its dependents' bounds fails here.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PUBLISHED = ("ap-tags", "ap-partitioner", "ap-bucketing", "ap-epchunk", "ap-backend")
NIGHTLY = "2.16.0.dev20261101"


def _module(name: str) -> str:
    return name.replace("-", "_")


def _pyproject(name: str) -> dict[str, Any]:
    return tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())


def source_version(name: str) -> str:
    """The version as written in the package's ``_version.py``."""
    path = ROOT / "packages" / name / "src" / _module(name) / "_version.py"
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and [
            t.id for t in node.targets if isinstance(t, ast.Name)
        ] == ["__version__"]:
            value = ast.literal_eval(node.value)
            assert isinstance(value, str)
            return value
    raise AssertionError(f"{path} assigns no __version__")


def _requirements(name: str) -> list[Requirement]:
    return [Requirement(r) for r in _pyproject(name)["project"].get("dependencies", [])]


def test_every_published_package_is_checked() -> None:
    on_disk = {p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml")}
    assert on_disk == {*PUBLISHED, "ap-testing"}


@pytest.mark.parametrize("name", PUBLISHED)
def test_the_version_is_written_once_and_read_back(name: str) -> None:
    project = _pyproject(name)
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["hatch"]["version"]["path"] == f"src/{_module(name)}/_version.py"
    version = source_version(name)
    Version(version)  # a valid PEP 440 version
    assert importlib.metadata.version(name) == version
    assert importlib.import_module(_module(name)).__version__ == version
    written = re.compile(r"""^\s*__version__\s*(:\s*str\s*)?=\s*["']""", re.M)
    for path in (ROOT / "packages" / name / "src").rglob("*.py"):
        if path.name != "_version.py":
            assert not written.search(path.read_text()), f"{path}: a second written version"


@pytest.mark.parametrize("name", [*PUBLISHED, "ap-testing"])
def test_the_torch_requirement_admits_the_next_nightly(name: str) -> None:
    (torch,) = [r for r in _requirements(name) if r.name == "torch"]
    # an installer accepts an installed pre-release when the specifier admits it
    assert torch.specifier.contains(NIGHTLY, prereleases=True), torch
    tested: tuple[str, ...] = importlib.import_module("ap_tags").TESTED_TORCH
    if name != "ap-testing":
        tested = importlib.import_module(f"{_module(name)}._compat").TESTED_TORCH
    assert all(torch.specifier.contains(v) for v in tested), (torch, tested)
    floors = [Version(s.version) for s in torch.specifier if s.operator == ">="]
    assert floors == [min(map(Version, tested))], f"{torch}: the floor is the oldest tested"


@pytest.mark.parametrize("name", PUBLISHED)
def test_sibling_requirements_are_bounded_and_admit_the_workspace_sibling(name: str) -> None:
    siblings = [r for r in _requirements(name) if r.name in PUBLISHED]
    for req in siblings:
        ops = {s.operator for s in req.specifier}
        assert ops & {">=", "~="} and ops & {"<", "~="}, f"{name}: {req} needs both bounds"
        assert req.specifier.contains(source_version(req.name), prereleases=True), (
            f"{name} requires {req}, which no longer admits the workspace's "
            f"{req.name} {source_version(req.name)}: widen the bound (and bump {name})"
        )
    expected = {
        "ap-tags": set(),
        "ap-bucketing": set(),
        "ap-partitioner": {"ap-tags"},
        "ap-epchunk": {"ap-tags"},
        "ap-backend": {"ap-tags", "ap-partitioner", "ap-bucketing", "ap-epchunk"},
    }
    assert {r.name for r in siblings} == expected[name]
