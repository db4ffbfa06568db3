"""The ap performance suite. Entry point: ``uv run python -m benchmarks [--quick] [--json PATH]``.

Each section lives in its own module exposing ``run(quick: bool) -> dict`` (JSON-serialisable)
and ``markdown(result: dict) -> str``. Sections use public names of the ap packages only, and
the workspace test kit (``ap_testing``) for the fake process group.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["markdown_table"]


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
