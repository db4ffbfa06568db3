"""Hash of this package's own source files, for cache keys that must change with the code."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path


def source_hash(root: Path) -> str:
    """sha256 over every ``.py`` file under ``root``, subpackages included, each with its path
    relative to ``root``, in a stable order.

    Subpackages count: the compat seam is one (``_compat/``), and an edit there (a changed
    lookup of a torch internal) changes what the pass does as much as an edit of a top-level
    module."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def package_source_hash() -> str:
    """:func:`source_hash` of this package.

    Inductor caches compiled graphs across processes; a cache key that ignored the bucketing
    code would hand back graphs bucketed by an older version of it.
    """
    return source_hash(Path(__file__).resolve().parent)
