"""The ap performance suite. Entry point: ``uv run python -m benchmarks [--quick] [--json PATH]``.

Each section lives in its own module exposing ``run(quick: bool) -> dict`` (JSON-serialisable)
and ``markdown(result: dict) -> str``.
"""
