"""Fixtures for the cross-package tests: the workspace's scripts, loaded as modules (they are
Python files without a ``.py`` suffix)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


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
