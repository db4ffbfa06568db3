"""``ap-backend demo``: the main job. Builds the spec, spawns the ranks, renders one table.

The table and ``--json`` are rendered from the same :func:`summarize` dict, so they cannot
disagree.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from ap_backend._spawn import spawn_ranks
from ap_backend._train import TrainSpec, Variant, run_rank
from ap_backend.models import ModelConfig

__all__ = ["DEMO_AC_STAGE_GIB", "DemoOptions", "render_table", "run_demo", "summarize"]

#: AC stage size for the demo model: ~32 KiB, i.e. a few stages per layer of this tiny model
#: ("auto" = sqrt(total GiB) GiB would make the whole model one stage).
DEMO_AC_STAGE_GIB = 3e-5


@dataclass(frozen=True)
class DemoOptions:
    layers: int = 2
    steps: int = 4
    ranks: int = 2
    ac: bool = True
    bucketing: bool = True
    chunk: bool = False
    attention: str = "matmul"


def build_spec(opts: DemoOptions) -> TrainSpec:
    kwargs: dict[str, Any] = {"enable_ac": opts.ac}
    if opts.ac:
        kwargs["ac_stage_size_gib"] = DEMO_AC_STAGE_GIB
    if opts.bucketing:
        kwargs["bucketing"] = True
        kwargs["overlap_scheduling"] = True
    if opts.chunk:
        from ap_epchunk import ChunkConfig

        kwargs["ep_chunk"] = ChunkConfig(
            module_patterns=("layers.*.moe",), num_chunks=2, early_grad_accumulation=False
        )
    # Chunking splits the batch dim of the token input: 4 sequences make chunks of 2 (a static
    # chunk of 1 cannot be told apart from broadcasting).
    model = ModelConfig(
        n_layers=opts.layers,
        moe=opts.chunk,
        attention=opts.attention,  # type: ignore[arg-type]
        batch=4 if opts.chunk else 2,
    )
    return TrainSpec(
        model=model,
        variants=(Variant("autoparallel", kwargs, first_compile_ac=opts.ac),),
        steps=opts.steps,
        measure_min_cut_ac=True,
        min_cut_ac_stage_gib=DEMO_AC_STAGE_GIB,
        progress=True,
    )


def summarize(opts: DemoOptions, ranks: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Rank 0's view (every rank runs the same program) plus the cross-rank agreement."""
    r0 = ranks[0]
    v = r0["variants"]["autoparallel"]
    second = (
        v["saved"][0] if v["saved"] else {"count": 0, "bytes": 0, "all_gather_outputs_saved": 0}
    )
    first = v["first_partition"]
    mc = r0["min_cut_ac"]
    mcu = r0["min_cut_ac_untagged"]
    return {
        "options": opts.__dict__,
        "steps": [
            {"step": i + 1, "loss_eager": le, "loss_compiled": lc, "abs_diff": abs(le - lc)}
            for i, (le, lc) in enumerate(zip(r0["eager"]["losses"], v["losses"], strict=True))
        ],
        "max_grad_rel_diff": max(r["variants"]["autoparallel"]["max_grad_rel_diff"] for r in ranks),
        "mismatches": sum(len(r["variants"]["autoparallel"]["mismatches"]) for r in ranks),
        "saved": {
            "first_partition": {
                k: first[k] for k in ("count", "bytes", "all_gather_outputs_saved")
            },
            "save_all": {k: second[k] for k in ("count", "bytes", "all_gather_outputs_saved")},
            "min_cut_ac": {k: mc[k] for k in ("count", "bytes", "all_gather_outputs_saved")},
            "min_cut_ac_untagged": {
                k: mcu[k] for k in ("count", "bytes", "all_gather_outputs_saved")
            },
        },
        "replay_fell_back": any(v["fell_back"]),
        "buckets_formed": sum(v["buckets"]),
        "chunked_regions_reports": v["chunk_reports"],
        "compile_s": {
            "precompile": v["precompile_s"],
            "backend": v["backend_compile_s"],
            "first_step": v["first_step_s"],
        },
        "step_s": {"eager": r0["eager"]["step_s"], "compiled": v["step_s"]},
        "wall_s": wall_s,
    }


def _kb(n: int) -> str:
    return f"{n:,} B"


def render_table(s: dict[str, Any]) -> str:
    o = s["options"]
    rows: list[tuple[str, str]] = []
    for st in s["steps"]:
        rows.append(
            (
                f"step {st['step']} loss eager / compiled",
                f"{st['loss_eager']:.6f} / {st['loss_compiled']:.6f}",
            )
        )
    rows.append(("max grad rel diff (all ranks, steps)", f"{s['max_grad_rel_diff']:.2e}"))
    labels = {
        "first_partition": "first partition (default)",
        "save_all": "SaveAll (backend)",
        "min_cut_ac": "min-cut + AC",
        "min_cut_ac_untagged": "min-cut + AC, no first compile",
    }
    for key, label in labels.items():
        sv = s["saved"][key]
        rows.append((f"saved activations: {label}", f"{sv['count']} ({_kb(sv['bytes'])})"))
    ag = " / ".join(str(s["saved"][k]["all_gather_outputs_saved"]) for k in labels)
    rows.append(("all-gather outputs saved (first / SaveAll / min-cut+AC / untagged)", ag))
    rows.append(("buckets formed (fw + bw)", str(s["buckets_formed"])))
    c = s["compile_s"]
    rows.append(
        ("compile time: precompile / backend", f"{c['precompile']:.2f} s / {c['backend']:.2f} s")
    )
    rows.append(("first step (incl. lazy backward compile)", f"{c['first_step']:.2f} s"))
    width = max(len(k) for k, _ in rows)
    vwidth = max(len(v) for _, v in rows)
    head = (
        f"ap-backend demo: {o['ranks']} ranks (gloo), {o['layers']} layers, {o['steps']} steps, "
        f"AC {'on' if o['ac'] else 'off'}, bucketing {'on' if o['bucketing'] else 'off'}, "
        f"chunk {'on' if o['chunk'] else 'off'}"
    )
    lines = [head, f"| {'quantity'.ljust(width)} | {'value'.ljust(vwidth)} |"]
    lines.append(f"|{'-' * (width + 2)}|{'-' * (vwidth + 2)}|")
    lines += [f"| {k.ljust(width)} | {v.ljust(vwidth)} |" for k, v in rows]
    return "\n".join(lines)


def run_demo(opts: DemoOptions, json_path: str | None = None) -> dict[str, Any]:
    start = time.perf_counter()
    ranks = spawn_ranks(run_rank, opts.ranks, build_spec(opts))
    summary = summarize(opts, ranks, time.perf_counter() - start)
    if json_path is not None:
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2)
    return summary
