"""The demo job: options -> a :class:`TrainSpec` -> spawned ranks -> one summary dict.

The table (:func:`~ap_backend.demo.render_table`) and ``--json`` are rendered from the same
:func:`summarize` dict, so they cannot disagree.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from ap_backend.demo._spawn import spawn_ranks
from ap_backend.demo._train import TrainSpec, Variant, run_rank
from ap_backend.models import ModelConfig

__all__ = [
    "DEMO_AC_STAGE_GIB",
    "DemoOptions",
    "build_spec",
    "expert_parallel_summary",
    "run_demo",
    "summarize",
]

#: AC stage size for the demo model: ~32 KiB, i.e. a few stages per layer of this tiny model
#: ("auto" = sqrt(total GiB) GiB would make the whole model one stage).
DEMO_AC_STAGE_GIB = 3e-5


@dataclass(frozen=True)
class DemoOptions:
    """What ``ap-backend demo`` runs: model depth, steps, gloo ranks, which passes are on
    (``ac``: AC staging in both compilations; ``bucketing``: ap-bucketing + overlap scheduling;
    ``chunk``: the MoE model with real expert parallelism, ``n_experts / ranks`` experts per
    rank and tokens exchanged all-to-all, ``layers.*.moe`` chunked in two along tokens) and the FSDP
    engine (``fsdp``: ``"ap"``, the model kit's all-gathers, or ``"simple"``, torchtitan's
    SimpleFSDP with DTensor parameters)."""

    layers: int = 2
    steps: int = 4
    ranks: int = 2
    ac: bool = True
    bucketing: bool = True
    chunk: bool = False
    attention: str = "matmul"
    fsdp: str = "ap"

    def __post_init__(self) -> None:
        if self.fsdp not in ("ap", "simple"):
            raise ValueError(f"DemoOptions: fsdp must be 'ap' or 'simple', got {self.fsdp!r}")
        if self.fsdp == "simple" and self.chunk:
            raise ValueError("DemoOptions: chunk needs the model kit's MoE (fsdp='ap')")


def build_spec(opts: DemoOptions) -> TrainSpec:
    """The one-variant training job for ``opts`` (plus the min-cut + AC measurements)."""
    kwargs: dict[str, Any] = {"enable_ac": opts.ac}
    if opts.ac:
        kwargs["ac_stage_size_gib"] = DEMO_AC_STAGE_GIB
    # --no-bucketing must say so: the backend buckets by default
    kwargs["bucketing"] = opts.bucketing
    if opts.bucketing:
        kwargs["overlap_scheduling"] = True
    if opts.chunk:
        from ap_epchunk import ChunkConfig

        kwargs["ep_chunk"] = ChunkConfig(module_patterns=("layers.*.moe",), num_chunks=2)
    # Chunking splits the batch dim of the token input: 4 sequences make chunks of 2 (a static
    # chunk of 1 cannot be told apart from broadcasting).
    model = ModelConfig(
        n_layers=opts.layers,
        moe=opts.chunk,
        ep=opts.chunk,
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
        fsdp="simple" if opts.fsdp == "simple" else "ap",
        measure_plain=True,
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
                k: first[k] for k in ("partitioner", "count", "bytes", "all_gather_outputs_saved")
            },
            "save_all": {k: second[k] for k in ("count", "bytes", "all_gather_outputs_saved")},
            "min_cut_ac": {k: mc[k] for k in ("count", "bytes", "all_gather_outputs_saved")},
            "min_cut_ac_untagged": {
                k: mcu[k] for k in ("count", "bytes", "all_gather_outputs_saved")
            },
            "plain_compile": {
                k: r0["plain_compile"][k] for k in ("count", "bytes", "all_gather_outputs_saved")
            },
        },
        "replay_fell_back": any(v["fell_back"]),
        "buckets_formed": sum(v["buckets"]),
        "chunked_regions_reports": v["chunk_reports"],
        "expert_parallel": expert_parallel_summary(opts, v) if opts.chunk else None,
        "compile_s": {
            "precompile": v["precompile_s"],
            "backend": v["backend_compile_s"],
            "first_step": v["first_step_s"],
        },
        "step_s": {"eager": r0["eager"]["step_s"], "compiled": v["step_s"]},
        "wall_s": wall_s,
    }


def expert_parallel_summary(opts: DemoOptions, v: dict[str, Any]) -> dict[str, Any]:
    """``--chunk``: the expert-parallel MoE's token exchange in the variant result ``v``, from what the backend compiled: ``before`` is the
    all-to-alls in one MoE layer's region body as the chunk pass found it (its
    ``ChunkReport``), ``after`` the all-to-alls per MoE layer in the partitioned graphs handed
    to Inductor (the backend's ``inner_compiles``), ``per_chunk`` = after / chunks."""
    spec = build_spec(opts)
    model, chunk = spec.model, spec.variants[0].backend_kwargs["ep_chunk"]
    regions = v["chunk_regions"]
    layers = model.n_layers
    out: dict[str, Any] = {
        "ranks": opts.ranks,
        "experts": model.n_experts,
        "experts_per_rank": model.n_experts // opts.ranks,
        "top_k": model.top_k,
        "moe_layers": layers,
        "num_chunks": chunk.num_chunks,
        "chunked_regions": len(regions),
        "whole_collectives": sorted({w for r in regions for w in r["whole_collectives"]}),
    }
    for direction, backward in (("forward", False), ("backward", True)):
        before = [r["all_to_alls"] for r in regions if r["backward"] == backward]
        compiled = sum(
            c["collectives"].get("all_to_all_single", 0)
            for c in v["inner_compiles"]
            if c["is_backward"] == backward
        )
        after = compiled / layers if layers else 0.0
        out[f"all_to_alls_{direction}"] = {
            "regions": len(before),
            "before": max(before) if before else 0,
            "after": after,
            "per_chunk": after / chunk.num_chunks,
            "compiled_total": compiled,
        }
    return out


def run_demo(opts: DemoOptions, json_path: str | None = None) -> dict[str, Any]:
    """Spawn ``opts.ranks`` gloo ranks, run :func:`build_spec`'s job, return :func:`summarize`'s
    dict (also written to ``json_path`` when given)."""
    start = time.perf_counter()
    ranks = spawn_ranks(run_rank, opts.ranks, build_spec(opts))
    summary = summarize(opts, ranks, time.perf_counter() - start)
    if json_path is not None:
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2)
    return summary
