"""Every Python example in every README runs as written: each ```python block, extracted
verbatim, runs in a fresh interpreter from the repository root and must exit 0."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
READMES = sorted(
    [ROOT / "README.md", ROOT / "zoo" / "README.md", *(ROOT / "packages").glob("*/README.md")]
)
_BLOCK = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)


def _examples() -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    for readme in READMES:
        text = readme.read_text(encoding="utf-8")
        for match in _BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{readme.relative_to(ROOT)}:{line}", match.group(1)))
    return found


EXAMPLES = _examples()

#: Examples whose code already runs in the default suite by another test, and takes minutes:
#: ``ap_backend.demo``'s (``run_demo`` + ``spawn_ranks``: 127 s in CI; ``tests/test_cli.py``
#: runs the demo, ``tests/test_multirank_gloo.py`` ``spawn_ranks(run_rank, ...)``). They run
#: under ``-m heavy``.
HEAVY_MARKERS = ("run_demo(",)


def _params() -> list[object]:
    return [
        pytest.param(
            where,
            code,
            id=where,
            marks=[pytest.mark.heavy] if any(m in code for m in HEAVY_MARKERS) else [],
        )
        for where, code in EXAMPLES
    ]


def test_the_readmes_have_examples() -> None:
    assert len(EXAMPLES) >= 8, [where for where, _ in EXAMPLES]


@pytest.mark.slow
@pytest.mark.parametrize(("where", "code"), _params())
def test_readme_example_runs_as_written(where: str, code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"{where}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
