"""The multi-process route: ``torchrun`` starts the ranks, this module is each rank's program.

::

    uv run torchrun --nproc-per-node 2 -m zoo.torchrun demo --steps 2
    uv run torchrun --nproc-per-node 2 -m zoo.torchrun zoo --model tt_llama3 --configs full
    uv run torchrun --nproc-per-node 2 -m zoo.meshes --rows accum_eval

Every rank initialises the default process group from torchrun's environment
(``init_process_group("gloo")``: ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``), runs
the same job the spawned route runs (``demo``: ``ap_backend.demo.run_rank`` on
``build_spec(DemoOptions(...))``, the ``ap-backend demo`` job; ``zoo``: ``zoo.run.run_case``
per configuration), and rank 0 gathers every rank's result and prints the same table the
spawned route prints (``ap-backend demo``'s table; ``python -m zoo``'s rows, numerics the
worst rank's). The exit status is 0 when every compiled run matches eager (demo) or every
case meets its done-when properties (zoo), on rank 0; other ranks exit 0.
"""

from __future__ import annotations

import os

# Inductor's FX-graph and AOTAutograd caches skip custom partitioners when they hit; this must
# happen before torch is imported (zoo/worker.py and the tests' conftest do the same).
os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import argparse  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from typing import Any  # noqa: E402

__all__ = ["main"]


def _init() -> tuple[int, int]:
    """The default process group from torchrun's environment; (rank, world size)."""
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit(
            "zoo.torchrun: RANK / WORLD_SIZE are not set: launch with "
            "`torchrun --nproc-per-node N -m zoo.torchrun ...`"
        )
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    # each rank its share of the cores, as the spawned route does (ap_backend.demo.spawn_ranks)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    return dist.get_rank(), world


def _gather(mine: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def _demo(args: argparse.Namespace, rank: int, world: int) -> int:
    from ap_backend.demo import DemoOptions, build_spec, render_table, run_rank, summarize

    opts = DemoOptions(
        layers=args.layers,
        steps=args.steps,
        ranks=world,
        ac=args.ac,
        bucketing=args.bucketing,
        fsdp=args.fsdp,
    )
    start = time.perf_counter()
    ranks = _gather(run_rank(rank, world, build_spec(opts)))
    if rank != 0:
        return 0
    summary = summarize(opts, ranks, time.perf_counter() - start)
    print(f"ap-backend demo under torchrun: {world} ranks (gloo, launched by torchrun)")
    print(render_table(summary))
    return 0 if summary["mismatches"] == 0 else 1


def _zoo(args: argparse.Namespace, rank: int, world: int) -> int:
    from zoo.report import attach_stock_gaps
    from zoo.run import CaseResult, evaluate, run_case
    from zoo.worker import _merge

    results = []
    for config in args.configs.split(","):
        record = run_case(args.model, config, steps=args.steps, rank=rank, ranks=world)
        results.append(CaseResult.from_dict(_merge(_gather(record.to_dict()))))
    if rank != 0:
        return 0
    attach_stock_gaps(results)
    failed = 0
    print(f"zoo under torchrun: {args.model}, {world} ranks (gloo, launched by torchrun)")
    print("| config | loss rel | grad rel | fallbacks | all-gather saved | verdict |")
    print("|---|---:|---:|---:|---|---|")
    for r in results:
        fails = evaluate(r).failures() if r.config != "stock" else (["error"] if r.error else [])
        failed += bool(fails)
        if r.loss_rel is None or r.grad_rel is None:
            print(f"| {r.config} | — | — | — | — | error: {r.error} |")
            continue
        structure = "— | —"
        if r.config != "stock":
            structure = f"{r.fallbacks} | {'/'.join(str(a) for a in r.all_gather_saved)}"
        verdict = "reference" if r.config == "stock" and not fails else "ok"
        print(
            f"| {r.config} | {r.loss_rel:.1e} | {r.grad_rel:.1e} | {structure} | "
            f"{verdict if not fails else ', '.join(fails)} |"
        )
    return 0 if failed == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchrun ... -m zoo.torchrun", description=__doc__)
    sub = parser.add_subparsers(dest="job", required=True)
    demo = sub.add_parser("demo", help="ap-backend demo's job, ranks started by torchrun")
    demo.add_argument("--layers", type=int, default=2)
    demo.add_argument("--steps", type=int, default=4)
    demo.add_argument("--ac", action=argparse.BooleanOptionalAction, default=True)
    demo.add_argument("--bucketing", action=argparse.BooleanOptionalAction, default=True)
    demo.add_argument("--fsdp", choices=("ap", "simple"), default="ap")
    zoo = sub.add_parser("zoo", help="one zoo model's cases, ranks started by torchrun")
    zoo.add_argument("--model", default="tt_llama3")
    zoo.add_argument("--configs", default="stock,full")
    zoo.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    rank, world = _init()
    import torch.distributed as dist

    try:
        return _demo(args, rank, world) if args.job == "demo" else _zoo(args, rank, world)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from zoo.teardown import exit_without_finalization

    exit_without_finalization(main())
