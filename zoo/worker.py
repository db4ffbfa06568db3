"""One model's cases in a fresh process:
``python -m zoo.worker MODEL CONFIG[,CONFIG...] --ranks N --out PATH``.

``python -m zoo`` runs every model through this module so that a crash (a native abort, a hang
past the timeout) costs one model's rows, not the run, and the import cost (torch,
transformers, torchtitan: tens of seconds on a loaded 2-core machine) is paid once per model.
Cases run in order with ``torch._dynamo.reset()`` between them; each case's JSON line is
appended to ``--out`` as soon as it is measured, so a crash keeps the cases before it. With
``--ranks 2`` it spawns two gloo ranks (FileStore); numerics are the worst over the ranks,
structure is rank 0's.
"""

from __future__ import annotations

import os

# Inductor's FX-graph and AOTAutograd caches skip custom partitioners when they hit; this must
# happen before torch is imported (the repository's conftest does the same for tests).
os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
# One compile thread: no compile-worker pool to start per process on a shared 2-core machine.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

__all__ = ["main", "run_ranks"]


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _append(path: str, record: dict[str, Any]) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def _rank_main(
    rank: int, world: int, store_path: str, model: str, configs: list[str], out: str
) -> None:
    _quiet()
    import torch.distributed as dist

    from zoo.run import run_case

    store = dist.FileStore(store_path, world)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
    try:
        for config in configs:
            _append(f"{out}.rank{rank}", run_case(model, config, rank=rank, ranks=world).to_dict())
    finally:
        dist.destroy_process_group()


def _merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's record with the worst numerics over all ranks: the largest loss / gradient
    error (and where the gradient one occurred), and for each fp64 pair the rank where the
    compiled run is furthest from eager fp64 relative to eager fp32 (``zoo.run.
    within_fp64_reference`` judges that rank; a rank without the pair met the fp32
    tolerances)."""
    from zoo.run import FP32_GRAD_RTOL, FP32_RTOL
    from zoo.verdict import misses_fp32

    merged = dict(parts[0])
    for key in ("loss_rel", "grad_rel"):
        vals = [p[key] for p in parts if p.get(key) is not None]
        merged[key] = max(vals) if len(vals) == len(parts) else None
    if merged["grad_rel"] is not None:
        merged["grad_worst"] = max(parts, key=lambda p: p["grad_rel"]).get("grad_worst", "")
    # the references ran on every rank once one rank missed the fp32 tolerances (their
    # collectives need every rank); only the ranks that missed are judged by them
    missed = [
        p
        for p in parts
        if misses_fp32(p.get("loss_rel"), p.get("grad_rel"), bf16=bool(p.get("bf16")))
    ]
    for key in ("fp64_loss_rel", "fp64_eager_loss_rel", "fp64_grad_rel", "fp64_eager_grad_rel"):
        merged[key] = None
    for got, ref, tol in (
        ("fp64_loss_rel", "fp64_eager_loss_rel", FP32_RTOL),
        ("fp64_grad_rel", "fp64_eager_grad_rel", FP32_GRAD_RTOL),
    ):
        measured = [p for p in missed if p.get(got) is not None and p.get(ref) is not None]
        if measured:
            worst = max(measured, key=lambda p: p[got] / max(p[ref], tol))
            merged[got], merged[ref] = worst[got], worst[ref]
    # every rank that missed the fp32 tolerances must have an undetermined eager fp32 and match
    # stock torch.compile (zoo.run.matches_stock_where_undetermined): all / worst over them
    undetermined = [
        p["eager_undetermined"] for p in missed if p.get("eager_undetermined") is not None
    ]
    merged["eager_undetermined"] = all(undetermined) if undetermined else None
    for key in ("jitter_eager_grad_rel", "vs_stock_loss_rel", "vs_stock_grad_rel"):
        vals = [p[key] for p in missed if p.get(key) is not None]
        merged[key] = max(vals) if vals else None
    errors = [f"rank {i}: {p['error']}" for i, p in enumerate(parts) if p.get("error")]
    if errors and not merged.get("error"):
        merged["error"] = "; ".join(errors)
    return merged


def run_ranks(model: str, configs: list[str], ranks: int, out: str) -> None:
    """Run ``model``'s cases on ``ranks`` gloo ranks in this process (1) or spawned processes
    (>1), appending one JSON line per case to ``out``."""
    if ranks == 1:
        import torch.distributed as dist

        from zoo.run import run_case

        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())  # type: ignore[attr-defined]
        try:
            for config in configs:
                _append(out, run_case(model, config).to_dict())
        finally:
            dist.destroy_process_group()
        return
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="zoo-ranks-") as tmp:
        part = os.path.join(tmp, "result")
        mp.spawn(  # type: ignore[attr-defined, no-untyped-call]
            _rank_main,
            args=(ranks, os.path.join(tmp, "store"), model, configs, part),
            nprocs=ranks,
            join=True,
        )
        per_rank = [
            [json.loads(ln) for ln in Path(f"{part}.rank{r}").read_text().splitlines()]
            for r in range(ranks)
        ]
    for cases in zip(*per_rank, strict=True):
        _append(out, _merge(list(cases)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zoo.worker")
    parser.add_argument("model")
    parser.add_argument("configs", help="comma-separated, run in this order")
    parser.add_argument("--ranks", type=int, default=1, choices=(1, 2))
    parser.add_argument("--out", required=True, help="JSON lines, one per case (appended)")
    args = parser.parse_args(argv)
    _quiet()
    run_ranks(args.model, args.configs.split(","), args.ranks, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
