"""ap-bucketing vs torch's own FSDP bucketing on stock ``torch.compile``, side by side.

``uv run python -m benchmarks.bucketing_side_by_side [--layers 8] [--engines ...]``

torchtitan's Llama3 (the zoo's builder, ``--layers``/``--dim``/``--seq``) on 2 gloo ranks, both
FSDP engines of ``zoo.bucketing`` (the zoo's ``FsdpTrainStep``, torchtitan's SimpleFSDP),
compiled by stock ``torch.compile`` (Inductor, min-cut partitioner) in four ways:

* ``none``: no bucketing;
* ``ours``: ``post_grad_custom_post_pass = OverlapBucketingPass(BucketingConfig())``
  (pre-bucketing + overlap scheduling under ap-bucketing's rules);
* ``torch_fx``: torch's FX bucketing passes, ``bucket_all_gathers_fx="only_fsdp"``,
  ``bucket_reduce_scatters_fx="fsdp"``;
* ``torch_overlap``: torch's overlap scheduler with its FSDP pre-bucketing
  (``aten_distributed_optimizations.enable_overlap_scheduling``), analytical CPU estimators.

Per case (fresh processes, fresh Inductor cache directory, FX/AOT caches off): the collectives
the compiled forward and backward issue (counted in Inductor's generated code), compile time
(the first step, forward + lazy backward compile included), the median of the later steps'
times, and for ``ours`` the pass's ``max_consec_compute_between_rs`` after scheduling. Times
are wall seconds on this 2-core machine with both ranks sharing it: read them as ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("none", "ours", "torch_fx", "torch_overlap")
ROOT = Path(__file__).resolve().parent.parent

_PATTERNS = {
    "all_gather": re.compile(r"_c10d_functional\.all_gather_into_tensor(?:_out)?\.default\("),
    "reduce_scatter": re.compile(r"_c10d_functional\.reduce_scatter_tensor\.default\("),
    "all_reduce": re.compile(r"_c10d_functional\.all_reduce_?\.default\("),
}


def _counts(code: str) -> dict[str, int]:
    return {kind: len(p.findall(code)) for kind, p in _PATTERNS.items()}


def _config(mode: str) -> tuple[dict[str, Any], Any]:
    from ap_bucketing import BucketingConfig, OverlapBucketingPass, cpu_runtime_estimation

    if mode == "none":
        return {}, None
    if mode == "ours":
        bucketing_pass = OverlapBucketingPass(BucketingConfig())
        return {"post_grad_custom_post_pass": bucketing_pass}, bucketing_pass
    if mode == "torch_fx":
        return {"bucket_all_gathers_fx": "only_fsdp", "bucket_reduce_scatters_fx": "fsdp"}, None
    if mode == "torch_overlap":
        opts = "aten_distributed_optimizations."
        return {
            opts + "enable_overlap_scheduling": True,
            opts + "compute_estimator": "analytical",
            opts + "enable_fusion_regions": False,
            opts + "custom_runtime_estimation": cpu_runtime_estimation,
        }, None
    raise ValueError(f"bucketing_side_by_side: unknown mode {mode!r}; known: {MODES}")


def bench_rank(
    rank: int, world: int, engine: str, mode: str, shape: dict[str, int], steps: int
) -> dict[str, Any]:
    import torch
    from ap_bucketing import cpu_overlap_estimators
    from torch._inductor.utils import run_and_get_code

    from zoo.bucketing import build, train
    from zoo.models.torchtitan_models import llama3
    from zoo.run import _rank_batches

    torch.manual_seed(0)
    zm = llama3(steps, n_layers=shape["layers"], dim=shape["dim"], seq=shape["seq"])
    step, params = build(engine, zm, world)
    batches = _rank_batches(zm, rank)
    patch, bucketing_pass = _config(mode)
    compiled = torch.compile(step)
    times: list[float] = []
    with torch._inductor.config.patch(patch), cpu_overlap_estimators(mode == "torch_overlap"):
        start = time.perf_counter()
        _, code = run_and_get_code(lambda: train(compiled, params, batches[:1]))
        compile_s = time.perf_counter() - start
        for batch in batches[1:]:
            start = time.perf_counter()
            train(compiled, params, [batch])
            times.append(time.perf_counter() - start)
    fw, bw = (_counts(c) for c in code[:2])
    consec = None
    if bucketing_pass is not None and bucketing_pass.reports:
        consec = bucketing_pass.reports[-1]["max_consec_compute_between_rs"][1]
    return {
        "forward": fw,
        "backward": bw,
        "compile_s": compile_s,
        "step_s": statistics.median(times) if times else None,
        "max_consec_compute_between_rs": consec,
    }


def run_case(engine: str, mode: str, shape: dict[str, int], steps: int) -> dict[str, Any]:
    from ap_backend.demo import spawn_ranks

    with tempfile.TemporaryDirectory(prefix="ap-bench-bucketing-") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        ranks = spawn_ranks(bench_rank, 2, engine, mode, shape, steps, timeout_s=1800.0)
    worst = max(ranks, key=lambda r: r["compile_s"])
    return {"engine": engine, "mode": mode, **worst}


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| engine | bucketing | fw AG / RS / AR | bw AG / RS / AR | compile s | "
        "compile / none | step s | step / none | max consec. compute between RS |\n"
        "|---|---|---|---|---:|---:|---:|---:|---:|"
    )
    base = {r["engine"]: r for r in rows if r["mode"] == "none"}
    lines = [head]
    for r in rows:
        b = base.get(r["engine"])

        def ratio(key: str, r: dict[str, Any] = r, b: dict[str, Any] | None = b) -> str:
            return f"{r[key] / b[key]:.2f}" if b and r[key] and b[key] else "—"

        fw, bw = r["forward"], r["backward"]
        consec = r["max_consec_compute_between_rs"]
        lines.append(
            f"| {r['engine']} | {r['mode']} | {fw['all_gather']} / {fw['reduce_scatter']} / "
            f"{fw['all_reduce']} | {bw['all_gather']} / {bw['reduce_scatter']} / "
            f"{bw['all_reduce']} | {r['compile_s']:.1f} | {ratio('compile_s')} | "
            f"{r['step_s']:.3f} | {ratio('step_s')} | {'—' if consec is None else consec} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bucketing_side_by_side")
    parser.add_argument("--engines", default="fsdp_step,simple_fsdp")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
    sys.path.insert(0, str(ROOT))
    shape = {"layers": args.layers, "dim": args.dim, "seq": args.seq}
    rows = []
    for engine in args.engines.split(","):
        for mode in args.modes.split(","):
            rows.append(run_case(engine, mode, shape, args.steps))
            print(f"[bucketing] {engine} {mode}: {json.dumps(rows[-1])}", flush=True)
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": shape, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
