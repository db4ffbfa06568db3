"""Fixtures for the cross-package tests: the workspace's scripts, loaded as modules (they are
Python files without a ``.py`` suffix), and the conformance zoo, importable as ``zoo``."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _import_zoo() -> None:
    """``zoo`` is a top-level directory of the (unpackaged) workspace root, importable with
    ``python -m zoo`` from the root; under pytest's importlib mode register it by location, so
    every test builds the zoo's models from the one definition of each."""
    if "zoo" in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(
        "zoo", ROOT / "zoo" / "__init__.py", submodule_search_locations=[str(ROOT / "zoo")]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["zoo"] = module
    spec.loader.exec_module(module)


_import_zoo()


def load_script(name: str) -> ModuleType:
    """``scripts/<name>`` as a fresh module object (its ``main`` is not run)."""
    path = ROOT / "scripts" / name
    loader = importlib.machinery.SourceFileLoader(f"ap_script_{name}", str(path))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@pytest.fixture
def matrix_script() -> ModuleType:
    return load_script("matrix")


@pytest.fixture
def release_script() -> ModuleType:
    return load_script("release")


#: ``run_zoo(models, configs, ranks)``: the JSON case records of one ``python -m zoo`` run.
RunZoo = Callable[[str, str, int], list[dict[str, Any]]]


@pytest.fixture
def run_zoo(tmp_path: Path) -> RunZoo:
    """Runs the zoo command as a user does (``python -m zoo --models M --configs C --ranks R``,
    from the root, into ``tmp_path``) and returns its case records; a failed command fails the
    test with the command's last output."""

    def run(models: str, configs: str, ranks: int) -> list[dict[str, Any]]:
        out = tmp_path / "zoo.json"
        cmd = [sys.executable, "-m", "zoo", "--models", models, "--configs", configs]
        cmd += ["--ranks", str(ranks), "--json", str(out), "--md", str(tmp_path / "zoo.md")]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
        if proc.returncode != 0 or not out.exists():
            pytest.fail(proc.stdout[-2000:] + proc.stderr[-2000:])
        cases: list[dict[str, Any]] = json.loads(out.read_text())["cases"]
        return cases

    return run


#: ``run_with_caches(args, cache)``: the JSON on the last stdout line of ``python <args>``.
RunWithCaches = Callable[[list[str], Path], Any]


@pytest.fixture
def run_with_caches() -> RunWithCaches:
    """Runs ``python <args>`` from the root in a fresh process with Inductor's FX-graph and
    AOTAutograd caches on, in the cache directory ``cache`` (this session forces both off,
    see the root conftest), and returns the JSON its stdout ends with: a restarted job is the
    same call again on the same ``cache``. A failed run fails the test with its stderr."""

    def run(args: list[str], cache: Path) -> Any:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache))
        env.update(TORCHINDUCTOR_FX_GRAPH_CACHE="1", TORCHINDUCTOR_AUTOGRAD_CACHE="1")
        proc = subprocess.run(
            [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return run


#: ``spawn_from_root(fn, world_size, *args, timeout_s=...)``: ``ap_backend.demo.spawn_ranks``
#: with the workspace root importable in the ranks.
SpawnFromRoot = Callable[..., list[Any]]


@pytest.fixture(scope="session")
def spawn_from_root() -> SpawnFromRoot:
    """``spawn_ranks`` for a rank function defined in a test module: the spawned ranks unpickle
    it by its module's name (and may import ``zoo``), both found from the workspace root, which
    is on ``sys.path`` only while they start (a spawned process copies the parent's path)."""
    from ap_backend.demo import spawn_ranks

    def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float) -> list[Any]:
        root = str(ROOT)
        added = root not in sys.path
        if added:
            sys.path.insert(0, root)
        try:
            return spawn_ranks(fn, world_size, *args, timeout_s=timeout_s)
        finally:
            if added:
                sys.path.remove(root)

    return spawn
