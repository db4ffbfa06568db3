"""The expert-parallel routes a user takes without ``precompile`` (issue 34): torchtitan's
MoE with real expert parallelism, ``torch.compile(step, backend=autoparallel_backend(ep_chunk=
ChunkConfig(("layers.*.moe",), num_chunks=N)))`` with ``capture_scalar_outputs=True`` (how
torchtitan's ``apply_compile`` users compile MoE), the tokens marked ``hint=N``, ``hint=None``
or not at all. ``hint=N`` trains like eager EP, every chunk exchanging its own tokens; the
other two refuse at compile time with a ``ChunkError`` naming the route that works (``hint=None``
used to compile and then fail at run time, as ``hint=N`` did before the per-chunk symbols
followed AOTAutograd's renamings).

``run_routes(cases)`` spawns ``REAL_EP_WORLD`` gloo ranks and returns, per case, what happened
on the worst rank: ``{"model", "marks", "num_chunks", "outcome", "stage", "error"}`` with
outcome ``"refused"`` (a ChunkError while compiling: Dynamo, AOTAutograd and the chunk pass
ran, nothing executed), ``"ok"`` (2 SGD steps, ``loss_rel`` / ``grad_rel`` against eager EP,
the worst rank's; ``all_to_all_fw`` / ``all_to_all_bw``: ``all_to_all_single`` in the
partitioned graphs handed to Inductor; ``moe_layers``; ``region_all_to_alls`` per chunked
region; ``schedule``: per region with exchanges ``[backward, exchanges_paired, exposed_before,
exposed_after, reason]``; ``seconds``: compile + 2 steps) or ``"failed"`` (anything else: the
case the test forbids).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from zoo.ep import EP_BATCH, PATTERN, REAL_EP_WORLD, _count_a2a, _moe_layers

__all__ = ["run_route_case", "run_routes"]


def run_route_case(model: str, marks: str, num_chunks: int) -> dict[str, Any]:
    """One case on this rank of an initialised gloo group (see the module docstring)."""
    import torch.distributed as dist
    from ap_backend import autoparallel_backend
    from ap_epchunk import ChunkConfig, ChunkError, mark_chunk_dim
    from ap_tags import annotate_module_fqns

    from zoo.models._base import token_batches
    from zoo.models.expert_parallel import EP_MODELS, cpu_expert_parallel
    from zoo.run import (
        _grads_rel,
        _loss_rel,
        _rank_batches,
        _shard_params,
        _sharded_step,
        _State,
        _train,
    )

    row: dict[str, Any] = {"model": model, "marks": marks, "num_chunks": num_chunks}
    stage = "build"
    torch._dynamo.reset()
    try:
        cpu_expert_parallel()
        zm = EP_MODELS[model](2)
        zm.batches = list(token_batches(2, batch=EP_BATCH))
        batches = _rank_batches(zm, dist.get_rank())
        step = _sharded_step(zm)
        params = _shard_params(step)
        state = _State(step)
        stage = "eager EP"
        ref_losses, ref_grads = _train(step, params, batches)
        state.restore()
        if marks != "none":
            for t in batches[0]:
                mark_chunk_dim(t, 0, hint=None if marks == "static" else t.shape[0])
        backend = autoparallel_backend(ep_chunk=ChunkConfig((PATTERN,), num_chunks=num_chunks))
        stage = "compiled (no precompile)"
        start = time.perf_counter()
        with (
            torch._dynamo.config.patch(capture_scalar_outputs=True),
            annotate_module_fqns(zm.module),
        ):
            losses, grads = _train(torch.compile(step, backend=backend), params, batches)
        row.update(
            outcome="ok",
            seconds=time.perf_counter() - start,
            loss_rel=_loss_rel(losses, ref_losses),
            grad_rel=_grads_rel(grads, ref_grads)[0],
            moe_layers=_moe_layers(zm.module),
            all_to_all_fw=_count_a2a(backend, backward=False),
            all_to_all_bw=_count_a2a(backend, backward=True),
            region_all_to_alls=[r.all_to_alls for r in backend.chunk_reports[-1].regions],
            schedule=[
                [r.backward, r.exchanges_paired, r.exposed_before, r.exposed_after, r.reason]
                for report in backend.schedule_reports
                for r in report.regions
            ],
        )
    except Exception as exc:  # noqa: BLE001 - every outcome is recorded
        # the chunk pass runs on the joint graph before any compiled code: a ChunkError
        # (Dynamo wraps it in BackendCompilerFailed) is a compile-time refusal
        inner = getattr(exc, "inner_exception", None) or exc.__cause__
        refused = isinstance(exc, ChunkError) or isinstance(inner, ChunkError)
        row.update(outcome="refused" if refused else "failed", stage=stage)
        row["error"] = f"{type(exc).__name__}: {str(exc)}"[:2000]
    finally:
        torch._dynamo.reset()
    return row


def _rank(rank: int, world: int, port: int, cases: list[tuple[str, str, int]], out: str) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = [run_route_case(*case) for case in cases]
    finally:
        dist.destroy_process_group()
    Path(f"{out}.{rank}").write_text(json.dumps(rows))


def run_routes(
    cases: list[tuple[str, str, int]], *, world: int = REAL_EP_WORLD, port: int = 29650
) -> list[dict[str, Any]]:
    """Spawn the ranks, run ``cases`` (model, marks, num_chunks) on each, and keep per case
    the worst rank's row (failed over refused over ok; between ok rows the larger loss and
    gradient errors)."""
    import torch.multiprocessing as mp

    root = str(Path(__file__).resolve().parent.parent)
    added = root not in sys.path
    if added:
        sys.path.insert(0, root)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = f"{tmp}/rows"
            mp.spawn(_rank, args=(world, port, cases, out), nprocs=world)  # type: ignore[attr-defined,no-untyped-call]
            per_rank = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    finally:
        if added:
            sys.path.remove(root)
    order = {"failed": 0, "refused": 1, "ok": 2}
    merged = []
    for rows in zip(*per_rank, strict=True):
        row = dict(min(rows, key=lambda r: order[r["outcome"]]))
        if all(r["outcome"] == "ok" for r in rows):
            row["loss_rel"] = max(r["loss_rel"] for r in rows)
            row["grad_rel"] = max(r["grad_rel"] for r in rows)
        merged.append(row)
    return merged
