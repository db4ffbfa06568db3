"""Hash of this package's own source files, for cache keys that must change with the code."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path


@functools.cache
def package_source_hash() -> str:
    """sha256 over every ``.py`` file of the package, in a stable order.

    Inductor caches compiled graphs across processes; a cache key that ignored the bucketing
    code would hand back graphs bucketed by an older version of it.
    """
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for path in sorted(root.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
