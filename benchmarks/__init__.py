"""The ap performance suite. Entry point: ``uv run python -m benchmarks [--quick] [--json PATH]``.

Each section lives in its own module exposing ``run(quick: bool) -> dict`` (JSON-serialisable)
and ``markdown(result: dict) -> str``. Sections use public names of the ap packages only, and
the workspace test kit (``ap_testing``) for the fake process group.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

__all__ = ["fresh_compile_env", "markdown_table"]


def fresh_compile_env(inductor_cache: str, pycache: str) -> dict[str, str]:
    """The environment of a compile-time worker: an empty Inductor cache of its own, the
    FX-graph and AOTAutograd caches off, no compile-worker pool, and Python bytecode read from
    and written to ``pycache`` (``PYTHONPYCACHEPREFIX``).

    Why the bytecode: an installed torch imports from its ``.pyc`` files, but a machine that
    sets ``PYTHONDONTWRITEBYTECODE=1`` (this one does) re-compiles the ~850 modules a compile
    imports from source in every fresh process -- seconds of import time in every
    configuration that are no compiler's cost. A caller fills ``pycache`` with an untimed
    small compile per configuration first."""
    env = dict(
        os.environ,
        TORCHINDUCTOR_CACHE_DIR=inductor_cache,
        TORCHINDUCTOR_FX_GRAPH_CACHE="0",
        TORCHINDUCTOR_AUTOGRAD_CACHE="0",
        TORCHINDUCTOR_COMPILE_THREADS="1",
        PYTHONPYCACHEPREFIX=pycache,
    )
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def markdown_table(columns: Sequence[tuple[str, str]], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table: ``columns`` are ``(heading, align)`` with align ``"l"`` or ``"r"``;
    every row has one already formatted cell per column."""
    rule = {"l": "---", "r": "---:"}
    lines = [
        "| " + " | ".join(heading for heading, _ in columns) + " |",
        "|" + "|".join(rule[align] for _, align in columns) + "|",
    ]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
