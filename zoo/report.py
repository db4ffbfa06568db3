"""``zoo/RESULTS.md``: one row per model x configuration, read at a glance.

``python -m zoo.report results.json [more.json ...] [--md RESULTS.md] [--json merged.json]``
re-renders the table from JSON runs; with several, a later run's case replaces an earlier one's
(same model and configuration) and the rows follow the zoo's model order.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

from zoo.run import (
    FP32_GRAD_RTOL,
    FP32_RTOL,
    FP64_MULTIPLIER,
    GRAD_FLOOR,
    CaseResult,
    evaluate,
    numerics_tolerance,
)

__all__ = ["attach_stock_gaps", "load", "render"]

COMMAND = "nice -n 10 uv run python -m zoo"


def _named_drops(why: dict[str, str]) -> str:
    """The named drops of one row, grouped by the kind of reason (the text before its first
    ``:``): how many, which, and one full reason as the example."""
    kinds: dict[str, list[str]] = {}
    for name in sorted(why):
        kinds.setdefault(why[name].split(":", 1)[0] or "unexplained", []).append(name)
    parts = []
    for kind, names in kinds.items():
        shown = ", ".join(f"`{n}`" for n in names[:4]) + (", ..." if len(names) > 4 else "")
        example = f"; e.g. `{names[0]}`: {why[names[0]]}" if why[names[0]] else ""
        parts.append(f"{len(names)} {kind} ({shown}{example})")
    return "; ".join(parts)


def load(path: str | Path) -> list[CaseResult]:
    data = json.loads(Path(path).read_text())
    return [CaseResult.from_dict(d) for d in data["cases"]]


def attach_stock_gaps(results: Sequence[CaseResult]) -> None:
    """Copy each model's stock-Inductor gap onto its ap rows (the bf16 tolerance)."""
    stock = {r.model: r for r in results if r.config == "stock" and r.error is None}
    for r in results:
        ref = stock.get(r.model)
        if r.config != "stock" and ref is not None:
            r.stock_loss_rel, r.stock_grad_rel = ref.loss_rel, ref.grad_rel


def _e(x: float | None) -> str:
    return "—" if x is None else f"{x:.1e}"


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}"


def _nb(count: int | None, nbytes: int | None) -> str:
    if count is None or nbytes is None:
        return "—"
    return f"{count} / {nbytes:,}"


def _verdict(r: CaseResult) -> str:
    if r.config == "stock":
        return "error" if r.error else "reference"
    fails = evaluate(r).failures()
    if "numerics" in fails and r.stock_grad_rel is not None and r.grad_rel is not None:
        if r.grad_rel <= r.stock_grad_rel and (r.loss_rel or 0.0) <= (r.stock_loss_rel or 0.0):
            fails[fails.index("numerics")] = "numerics (within stock gap)"
    return "**ok**" if not fails else ", ".join(fails)


def _fp64_text(r: CaseResult) -> str:
    if r.fp64_grad_rel is None:
        return ""
    text = (
        f" distance to eager fp64: compiled loss {_e(r.fp64_loss_rel)} / grad "
        f"{_e(r.fp64_grad_rel)}, eager fp32 loss {_e(r.fp64_eager_loss_rel)} / grad "
        f"{_e(r.fp64_eager_grad_rel)}"
    )
    if r.jitter_eager_grad_rel is not None:
        text += f", eager fp32 jittered by one ulp grad {_e(r.jitter_eager_grad_rel)}"
    if r.eager_undetermined:
        text += "; eager fp32 undetermined"
        if r.vs_stock_grad_rel is not None:
            text += (
                f", compiled vs stock torch.compile loss {_e(r.vs_stock_loss_rel)} / grad "
                f"{_e(r.vs_stock_grad_rel)}"
            )
    return text


def _row(r: CaseResult) -> str:
    if r.config == "stock":
        cells = [
            r.model,
            r.config,
            _e(r.loss_rel),
            _e(r.grad_rel),
            "—",
            "—",
            "—",
            "—",
            "—",
            "—",
            "—",
            _s(r.first_step_s),
            _verdict(r),
        ]
        return "| " + " | ".join(cells) + " |"
    tol = numerics_tolerance(r)
    tol_s = "—" if tol is None else f"{_e(tol[0])} / {_e(tol[1])}"
    first = _nb(r.first.count, r.first.nbytes) if r.first else "—"
    if r.tagged_min_cut is not None:
        first += f" (tagged min-cut {_nb(r.tagged_min_cut.count, r.tagged_min_cut.nbytes)})"
    ag = "/".join("—" if a is None else str(a) for a in r.all_gather_saved)
    fb = "—" if not r.reports else f"{r.fallbacks}/{len(r.reports)}"
    chains = "—" if r.fsdp_chains is None else f"{r.fsdp_chains}/{r.n_shards}"
    cells = [
        r.model,
        r.config,
        _e(r.loss_rel),
        _e(r.grad_rel),
        tol_s,
        chains,
        first,
        _nb(r.saved_count, r.saved_bytes),
        _nb(r.report_count, r.report_bytes),
        ag,
        fb,
        f"{_s(r.precompile_s)} / {_s(r.backend_s)} / {_s(r.first_step_s)}",
        _verdict(r),
    ]
    return "| " + " | ".join(cells) + " |"


_HEADER = (
    "| model | config | loss rel | grad rel | tol | FSDP chains | first partition (n / B) "
    "| SaveAll (n / B) | PartitionReport (n / B) | AG saved f/S/R | fallbacks "
    "| precompile / backend / 1st step (s) | verdict |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)

_LEGEND = f"""\
**Legend.** One row per model x configuration: `default` = `autoparallel_backend()`, `ac` =
`autoparallel_backend(enable_ac=True)`, `full` = `autoparallel_backend(enable_ac=True,
bucketing=True, overlap_scheduling=True)`; `stock` = plain `torch.compile` (Inductor) of the
same sharded train step on the same batches, no first compilation (stock Inductor's gap in the
same world: the reference gap for bf16 models).
Parameters are FSDP-style dim-0 shards all-gathered in forward (`zoo/fsdp.py`).

* **loss rel / grad rel**: relative error vs eager; for gradients per shard tensor
  `max|compiled - eager| / max(max|eager|, {GRAD_FLOOR:.0e} x the step's largest |eager| entry)`,
  worst over steps, shards and ranks (the floor keeps mathematically-zero gradients, such as
  attention key biases, from comparing round-off with round-off). **tol** (loss / grad):
  {FP32_RTOL:.0e} / {FP32_GRAD_RTOL:.0e} for fp32 models; for bf16 models stock Inductor's own
  gap (never below those). An fp32 case above tol is
  judged as torch's own accuracy check does (`torch._dynamo.utils.same` with an fp64
  reference): it passes when its distance to eager fp64 of the same sharded step is at most
  {FP64_MULTIPLIER:g} x eager fp32's (both floored at tol); and where eager fp32 is itself
  further than tol from eager fp64, or eager fp32 on parameters jittered by one ulp is further
  than tol from eager fp32 (*eager fp32 undetermined*: a ReLU + BatchNorm network at a kink,
  zoo/README.md "Two ranks"), when it matches plain `torch.compile` of the same step on
  the same batches within tol. Such rows are listed under *fp64-judged*.
* **FSDP chains**: all-gather chains ap-tags found in the first compilation / parameter shards.
* **first partition**: `PrecompiledModule.first_partition` (distinct saved storages / bytes);
  **SaveAll**: `AutoParallelBackend.saved` (same measure, summed over the compile's
  partitions); **PartitionReport**: ap-partitioner's `saved_activation_count/bytes`.
* **AG saved f/S/R**: all-gather outputs saved, by first partition / SaveAll / PartitionReport.
* **fallbacks**: PartitionReports with `fell_back` / reports.
* **verdict**: `ok`, or each done-when property that fails: `numerics` (above tol),
  `fallbacks` (> 0), `all-gather saved` (> 0 in any measure), `SaveAll bytes > first` (AC off
  only), `saved measures disagree` (AC off: first = SaveAll = PartitionReport, count and
  bytes; AC on: SaveAll = PartitionReport), `error` (see *Errors*).
"""


def render(
    results: Sequence[CaseResult], *, command: str | Sequence[str] = COMMAND, wall_s: float = 0.0
) -> str:
    import torch

    commands = [command] if isinstance(command, str) else list(command)
    lines = ["# Conformance zoo: results", ""]
    models = sorted({r.model for r in results})
    libs = sorted({r.library.split(" ")[0] for r in results if r.library})
    ap = [r for r in results if r.config != "stock"]
    ok = [r for r in ap if not evaluate(r).failures()]
    ranks = sorted({r.ranks for r in results})
    lines += [
        f"Command: {' + '.join(f'`{c}`' for c in commands)} (wall {wall_s / 60:.1f} min). "
        f"torch {torch.__version__}, "
        f"Python {platform.python_version()}, {'/'.join(map(str, ranks))} gloo rank(s), "
        f"{results[0].steps if results else 0} SGD steps per case, CPU.",
        "",
        f"{len(models)} models from {len(libs)} libraries ({', '.join(libs)}); "
        f"{len(ok)} of {len(ap)} ap cases meet every done-when property.",
        "",
        _HEADER,
    ]
    lines += [_row(r) for r in results]
    lines += ["", _LEGEND]
    judged = [r for r in results if r.fp64_grad_rel is not None]
    if judged:
        lines += ["## fp64-judged", ""]
        lines += [
            f"* `{r.model}` / `{r.config}`: vs eager fp32 loss {_e(r.loss_rel)}, grad "
            f"{_e(r.grad_rel)} at {r.grad_worst or '?'};{_fp64_text(r)}"
            for r in judged
        ]
        lines.append("")
    lines += ["## Errors and fallback reasons", ""]
    seen: set[str] = set()
    for r in results:
        if r.error:
            lines.append(f"* `{r.model}` / `{r.config}` ({r.error_stage}): `{r.error}`")
        if r.config != "stock" and evaluate(r).numerics is False:
            lines.append(
                f"* `{r.model}` / `{r.config}` numerics: loss rel {_e(r.loss_rel)}, grad rel "
                f"{_e(r.grad_rel)} at {r.grad_worst or '?'} (stock Inductor: loss "
                f"{_e(r.stock_loss_rel)}, grad {_e(r.stock_grad_rel)}){_fp64_text(r)}"
            )
        for rep in r.reports:
            if rep.fell_back and rep.fallback_reason:
                first = rep.fallback_reason.strip().splitlines()
                text = " ".join(s.strip() for s in first[:2])[:300]
                key = f"{r.model}:{text}"
                if key not in seen:
                    seen.add(key)
                    lines.append(f"* `{r.model}` / `{r.config}` fallback: `{text}`")
        why: dict[str, str] = {}
        for rep in r.reports:
            reasons = rep.dropped_first_saves_why or [""] * len(rep.dropped_first_saves)
            for name, reason in zip(rep.dropped_first_saves, reasons, strict=True):
                why.setdefault(name, reason)
        if why and r.config == "default":
            lines.append(
                f"* `{r.model}` / `{r.config}` replay saves fewer than the first partition "
                f"(judged exact less these): {_named_drops(why)}"
            )
        narrowed = sorted({d for rep in r.reports for d in rep.narrowed_first_saves})
        if narrowed and r.config == "default":
            lines.append(
                f"* `{r.model}` / `{r.config}` replay saves {len(narrowed)} widening "
                f"cast{'s' if len(narrowed) > 1 else ''} as their narrow source: "
                f"{', '.join(f'`{d}`' for d in narrowed)} (the backward "
                "recomputes the cast; judged exact with the source's storage in the cast's place)"
            )
    lines += ["", "## Models", ""]
    lines += ["| model | library | configuration | parameters |", "|---|---|---|---|"]
    done: set[str] = set()
    for r in results:
        if r.model in done or not r.library:
            continue
        done.add(r.model)
        lines.append(f"| {r.model} | {r.library} | {r.model_config} | {r.n_params:,} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zoo.report")
    parser.add_argument("json_paths", nargs="+")
    parser.add_argument("--md", default=None, help="write here instead of stdout")
    parser.add_argument("--json", default=None, help="also write the merged JSON record here")
    args = parser.parse_args(argv)
    from zoo.models import MODELS
    from zoo.run import CONFIGS

    cases: dict[tuple[str, str], dict[str, object]] = {}
    commands: list[str] = []
    wall = 0.0
    for path in args.json_paths:
        data = json.loads(Path(path).read_text())
        commands.append(str(data.get("command", COMMAND)))
        wall += float(data.get("wall_s", 0.0))
        for case in data["cases"]:
            cases[(case["model"], case["config"])] = case
    order = {m: i for i, m in enumerate(MODELS)}
    keys = sorted(cases, key=lambda k: (order.get(k[0], len(order)), CONFIGS.index(k[1])))
    results = [CaseResult.from_dict(cases[k]) for k in keys]
    attach_stock_gaps(results)
    text = render(results, command=commands, wall_s=wall)
    if args.json:
        payload: dict[str, object] = {"command": " + ".join(commands), "wall_s": wall}
        payload["cases"] = [cases[k] for k in keys]
        Path(args.json).write_text(json.dumps(payload, indent=1) + "\n")
    if args.md:
        Path(args.md).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
