"""Time-vs-graph-size PNGs for sections 2–4 (matplotlib from the dev group).

Kept apart from the sections so a section stays runnable without matplotlib; the suite's
``--plots DIR`` calls :func:`plot_section` after each section.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

Series = dict[str, list[tuple[float, float]]]


@dataclass(frozen=True)
class _Plot:
    """One PNG: which rows of a section's result it reads and which (x, y) keys per line."""

    file: str
    title: str
    xlabel: str
    ylabel: str
    rows: str
    lines: dict[str, tuple[str, str]]

    def series(self, result: dict[str, Any]) -> Series:
        rows = result[self.rows]
        return {label: [(r[x], r[y]) for r in rows] for label, (x, y) in self.lines.items()}


_PLOTS: dict[str, _Plot] = {
    "partitioner": _Plot(
        "partitioner_time.png",
        "Partitioner wall time (AC on)",
        "joint graph nodes",
        "ms (median)",
        "timing",
        {"SaveAll": ("joint_nodes", "save_all_ms"), "min-cut": ("joint_nodes", "min_cut_ms")},
    ),
    "bucketing": _Plot(
        "bucketing_time.png",
        "FSDP all-gather bucketing decision",
        "graph nodes",
        "ms (median)",
        "rows",
        {"patched": ("nodes", "patched_ms"), "upstream": ("nodes", "upstream_ms")},
    ),
    "chunking": _Plot(
        "chunking_time.png",
        "EP chunk pass time",
        "joint graph nodes (before)",
        "s (median)",
        "rows",
        {"chunk pass + concretize": ("nodes_before", "seconds")},
    ),
}


def _draw(path: Path, plot: _Plot, series: Series) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in series.items():
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_title(plot.title)
    ax.set_xlabel(plot.xlabel)
    ax.set_ylabel(plot.ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


#: section 6's partitions, in bar order: (key in a row's "partitions", legend label)
_SAVED_BARS = (
    ("plain", "plain torch.compile"),
    ("tagged_min_cut", "tagged min-cut"),
    ("replay_min_cut", "replay of min-cut first"),
    ("replay_default", "replay of default_partition first"),
    ("plain_ac", "plain + AC"),
    ("replay_min_cut_ac", "replay of min-cut first + AC"),
)


def _draw_saved(path: Path, result: dict[str, Any]) -> str:
    """Grouped bars: saved activation MiB (graph measure; hatched part = all-gather outputs)
    per partition, one group per model and layer count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    width = 0.8 / len(_SAVED_BARS)
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, (key, label) in enumerate(_SAVED_BARS):
        xs = [j + i * width for j in range(len(rows))]
        total = [r["partitions"][key]["bytes"] / 2**20 for r in rows]
        gathered = [(r["partitions"][key].get("all_gather_bytes") or 0) / 2**20 for r in rows]
        ax.bar(xs, total, width, label=label)
        ax.bar(xs, gathered, width, bottom=0, fill=False, hatch="//", edgecolor="black")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels([f"{r['model']}\n{r['layers']} layers" for r in rows])
    ax.set_ylabel("saved for backward, MiB (hatched: all-gather outputs)")
    ax.set_title("Activation memory saved for backward (graph measure)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def plot_section(name: str, result: dict[str, Any], out: Path) -> list[str]:
    """PNG paths drawn for section ``name`` (none for sections without a size axis)."""
    if name == "real_models" and result.get("rows"):
        out.mkdir(parents=True, exist_ok=True)
        return [_draw_saved(out / "real_models_saved.png", result)]
    plot = _PLOTS.get(name)
    if plot is None:
        return []
    out.mkdir(parents=True, exist_ok=True)
    return [_draw(out / plot.file, plot, plot.series(result))]
