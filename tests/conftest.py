"""Fixtures for the cross-package tests: the workspace's scripts, loaded as modules (they are
Python files without a ``.py`` suffix), and the conformance zoo, importable as ``zoo``."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

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
