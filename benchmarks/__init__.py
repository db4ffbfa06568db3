"""The ap performance suite. Entry point: ``uv run python -m benchmarks [--quick] [--json PATH]``.

Each section lives in its own module exposing ``run(quick: bool) -> dict`` (JSON-serialisable)
and ``markdown(result: dict) -> str``. Sections use public names of the ap packages only, and
the workspace test kit (``ap_testing``) for the fake process group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["fresh_compile_env", "markdown_table", "run_worker"]


def run_worker(module: str, args: Sequence[str], env: Mapping[str, str]) -> dict[str, Any]:
    """``python -m <module> --worker <args>`` in a fresh process with ``env``: the JSON object
    on the last line of its stdout, plus ``load_before`` / ``load_after`` (the 1-minute load
    average around it: this machine is shared). A worker that fails raises ``RuntimeError``
    with the last lines of what it printed."""
    load = os.getloadavg()[0]
    proc = subprocess.run(
        [sys.executable, "-m", module, "--worker", *args],
        env=dict(env),
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"{module} worker {list(args)[:1]} failed: " + " | ".join(tail))
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["load_before"] = round(load, 2)
    out["load_after"] = round(os.getloadavg()[0], 2)
    return out


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
