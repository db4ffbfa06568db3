"""``SaveAllPartitioner.uuid()`` covers ap-tags: the save rules read the tags through ap-tags'
accessors, keys and graph vocabulary, so a different ap-tags (a new release, or the same version
edited in place) must miss Inductor's cache instead of replaying a stale partition."""

from __future__ import annotations

import sys
from pathlib import Path

import ap_tags
import pytest
from ap_partitioner import SaveAllPartitioner, _partitioner


def test_uuid_changes_with_the_ap_tags_version(monkeypatch: pytest.MonkeyPatch) -> None:
    base = SaveAllPartitioner().uuid()
    monkeypatch.setattr(ap_tags, "__version__", "0.1.1")
    assert SaveAllPartitioner().uuid() != base
    monkeypatch.undo()
    assert SaveAllPartitioner().uuid() == base


def test_uuid_changes_with_the_ap_tags_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    base = SaveAllPartitioner().uuid()
    monkeypatch.setattr(_partitioner, "ap_tags_source_hash", lambda: "edited")
    assert SaveAllPartitioner().uuid() != base
    assert SaveAllPartitioner(strict=True).uuid() != SaveAllPartitioner().uuid()


def test_ap_tags_hash_covers_every_loaded_ap_tags_module() -> None:
    """Every loaded ``ap_tags`` module is among the hashed files (a new or renamed module is
    covered without a list to update)."""
    root = Path(ap_tags.__file__).resolve().parent
    loaded = {
        Path(m.__file__).resolve()
        for name, m in sys.modules.items()
        if (name == "ap_tags" or name.startswith("ap_tags.")) and m.__file__
    }
    hashed = {p.resolve() for p in root.rglob("*.py")}
    assert loaded and loaded <= hashed
    assert {p.name for p in loaded} >= {"_accessors.py", "_keys.py", "graph.py"}
    assert _partitioner.dependencies_key().startswith(f"ap-tags=={ap_tags.__version__}:")
