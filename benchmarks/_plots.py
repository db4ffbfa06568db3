"""Time-vs-graph-size PNGs for sections 2–4 (matplotlib from the dev group).

Kept apart from the sections so a section stays runnable without matplotlib; the suite's
``--plots DIR`` calls :func:`plot_section` after each section.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

Series = dict[str, list[tuple[float, float]]]


def _draw(path: Path, title: str, xlabel: str, ylabel: str, series: Series) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in series.items():
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def _partitioner(result: dict[str, Any], out: Path) -> list[str]:
    rows = result["timing"]
    series: Series = {
        "SaveAll": [(r["joint_nodes"], r["save_all_ms"]) for r in rows],
        "min-cut": [(r["joint_nodes"], r["min_cut_ms"]) for r in rows],
    }
    return [
        _draw(
            out / "partitioner_time.png",
            "Partitioner wall time (AC on)",
            "joint graph nodes",
            "ms (median)",
            series,
        )
    ]


def _bucketing(result: dict[str, Any], out: Path) -> list[str]:
    rows = result["rows"]
    series: Series = {
        "patched": [(r["nodes"], r["patched_ms"]) for r in rows],
        "upstream": [(r["nodes"], r["upstream_ms"]) for r in rows],
    }
    return [
        _draw(
            out / "bucketing_time.png",
            "FSDP all-gather bucketing decision",
            "graph nodes",
            "ms (median)",
            series,
        )
    ]


def _chunking(result: dict[str, Any], out: Path) -> list[str]:
    rows = result["rows"]
    series: Series = {"chunk pass + concretize": [(r["nodes_before"], r["seconds"]) for r in rows]}
    return [
        _draw(
            out / "chunking_time.png",
            "EP chunk pass time",
            "joint graph nodes (before)",
            "s (median)",
            series,
        )
    ]


_PLOTTERS: dict[str, Callable[[dict[str, Any], Path], list[str]]] = {
    "partitioner": _partitioner,
    "bucketing": _bucketing,
    "chunking": _chunking,
}


def plot_section(name: str, result: dict[str, Any], out: Path) -> list[str]:
    """PNG paths drawn for section ``name`` (none for sections without a size axis)."""
    plotter = _PLOTTERS.get(name)
    if plotter is None:
        return []
    out.mkdir(parents=True, exist_ok=True)
    return plotter(result, out)
