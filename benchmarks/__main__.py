"""Run the whole ap performance suite side by side and print one markdown table per section.

    uv run python -m benchmarks [--quick] [--json PATH] [--plots DIR] [--only SECTION ...]

Every section module exposes ``run(quick: bool) -> dict`` and ``markdown(result) -> str``;
:mod:`benchmarks._plots` draws the time-vs-size PNGs of sections 2–4.
Absolute times on a shared 2-core machine are noisy, so sections report medians of repeated
runs and the ratios the goals are stated in.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._plots import plot_section

#: (module, heading), in the order the sections run and print.
SECTIONS: tuple[tuple[str, str], ...] = (
    ("memory", "1. Activation memory saved for backward"),
    ("partitioner", "2. Partitioner time: SaveAll vs min-cut"),
    ("bucketing", "3. Bucketing: patched vs upstream"),
    ("chunking", "4. Chunk pass time and node counts"),
    ("e2e", "5. End to end on the demo model"),
    ("real_models", "6. Real models: activation memory saved for backward (graph and run time)"),
    ("real_models_compile", "7. Real models: compile time and step time vs stock Inductor"),
    ("projection", "8. Projection to LLaMA-3 8B on 128 ranks: saved bytes, exact partitions"),
    ("kernels", "9. Generated kernels, saved bytes and compile time at the CPU shape"),
    ("gpu", "10. Step time, peak memory, saved bytes and kernels (benchmarks.gpu, CPU)"),
)


def _environment() -> dict[str, Any]:
    import torch

    return {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cores": os.cpu_count(),
        "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="smallest sizes only (< 3 minutes)")
    parser.add_argument("--json", type=Path, help="also write every section's data here")
    parser.add_argument("--plots", type=Path, help="directory for time-vs-size PNG plots")
    names = [name for name, _ in SECTIONS]
    parser.add_argument("--only", nargs="+", choices=names, help="run only these sections")
    args = parser.parse_args(argv)

    env = _environment()
    print(
        f"# ap benchmarks ({'quick' if args.quick else 'full'}) — {env['date']}, torch "
        f"{env['torch']}, {env['cores']} cores, {env['ram_gib']} GiB RAM, load average "
        f"{env['load_avg_1m_at_start']} at start\n"
    )
    data: dict[str, Any] = {"environment": env, "quick": args.quick, "sections": {}}
    failed: list[str] = []
    for name, heading in SECTIONS:
        if args.only and name not in args.only:
            continue
        module = importlib.import_module(f"benchmarks.{name}")
        start = time.perf_counter()
        try:
            result = module.run(quick=args.quick)
        except Exception as exc:  # report every section, then fail the run
            failed.append(name)
            print(f"## {heading}\n\nFAILED: {type(exc).__name__}: {exc}\n", flush=True)
            data["sections"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        elapsed = time.perf_counter() - start
        data["sections"][name] = result
        print(
            f"## {heading}\n\n{module.markdown(result)}\n\n_section wall time {elapsed:.1f} s_\n",
            flush=True,
        )
        if args.plots is not None:
            for path in plot_section(name, result, args.plots):
                print(f"plot: {path}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=2, default=str))
        print(f"json: {args.json}")
    if failed:
        print(f"benchmarks: sections failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
