"""The meshes and training loops users train with (issue #23, item 2): ``python -m zoo.meshes``.

Each *row* is a real model (``zoo.mesh_models``: torchtitan's Llama3 and Qwen3-MoE debug
models, transformers' Llama) on torchtitan 0.3.0's ``ParallelDims`` mesh (``build_mesh``),
tensor-parallelised by its own library's plan when the mesh has a ``tp`` axis (torchtitan's
sharding configs through ``model.parallelize(parallel_dims)``; transformers' ``tp_plan``
through ``parallelize_module``), then ``graph_trainer.common_utils.apply_simple_fsdp``
(SimpleFSDP: ``fully_shard`` on the ``fsdp`` axis, ``hybrid_shard`` on ``(dp_replicate,
fsdp)``, with the ``MixedPrecisionPolicy`` of the ``TrainingConfig``) -- trained eagerly, then
through ``precompile`` + ``torch.compile(backend=autoparallel_backend(enable_ac=True,
bucketing=True, overlap_scheduling=True))`` (the full configuration) on the same rank's
batches, and compared. The loops and meshes (Llama3's rows are named by them alone, the
others prefixed ``qwen3_moe_`` / ``hf_llama_``):

* ``accum_eval`` (2 ranks, FSDP 2): 2 micro-batches per step (``(loss / 2).backward()``
  each, one optimizer step on the accumulated gradients), 2 steps, and a ``torch.no_grad()``
  evaluation of a held-out batch between the steps; the compiled module is called for every
  micro-batch and the evaluation (one training graph + one inference graph, no recompile per
  micro-batch);
* ``bf16`` (2 ranks, FSDP 2): ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``,
  2 steps; judged against stock ``torch.compile``'s gap on the same step in the same run
  (ap's gap <= 2x stock's);
* ``hsdp_2x2`` (4 ranks): ``hybrid_shard`` on a (dp_replicate 2, fsdp 2) mesh;
* ``fsdp_tp_2x2`` (4 ranks): tensor parallel on ``tp`` (2), SimpleFSDP ``fully_shard`` on
  ``fsdp`` (2); the bucketing pass must bucket the ``fsdp`` group's collectives only.

Numerics: every micro-batch loss and evaluation loss (relative error) and each step's
accumulated gradient shard on every rank (``zoo.run``'s normwise relative error), fp32: loss
1e-5, gradients 1e-4; a bf16 row or a model with bf16 parts (Qwen3-MoE's grouped experts, as
``zoo.run`` judges it) within 2x stock ``torch.compile``'s gap in the same run. The eager
mesh's first loss against the unparallelised model's (``mesh_vs_unsharded``, fp32
parameters: 1e-5). Structure: zero ap-partitioner fallbacks, no Dynamo graph break, the
number of graphs the backend compiled, and per graph the collectives of each process group
(mesh axis) before -> after the bucketing pass.

CPU substitutions (each needed on a machine without CUDA; the model is not changed):
``zoo.models.expert_parallel.cpu_expert_parallel()`` (mesh on CPU, partial-DTensor SPMD,
the ``fake`` backend for size-1 axes), gloo process groups, and torchtitan's
``ScaledDotProductAttention`` as every zoo row (``zoo/README.md``).

Launch: spawned gloo ranks (``python -m zoo.meshes --rows accum_eval``), or ``torchrun
--nproc-per-node N -m zoo.meshes --rows ...`` (the process group comes from torchrun's
environment; rank 0 prints the table).
"""

from __future__ import annotations

import os

# Inductor's FX-graph and AOTAutograd caches skip custom partitioners when they hit; this must
# happen before torch is imported (zoo/worker.py and the tests' conftest do the same).
os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from zoo.mesh_models import (  # noqa: E402
    MESH_MODELS,
    ROWS,
    Row,
    batches,
    build,
    parallel_dims,
    torchtitan_loss,
    unsharded_loss,
)
from zoo.mesh_report import (  # noqa: E402
    BF16_MULTIPLIER,
    GRAD_RTOL,
    LOSS_RTOL,
    GroupCounting,
    RowResult,
    _by_group,
    axis_names,
    bucketed_axes,
    combine,
    count_pass,
    evaluate,
    expected_graphs,
    render,
)

__all__ = [
    "BF16_MULTIPLIER",
    "GRAD_RTOL",
    "LOSS_RTOL",
    "MESH_MODELS",
    "ROWS",
    "GroupCounting",
    "Row",
    "RowResult",
    "_by_group",
    "batches",
    "bucketed_axes",
    "build",
    "combine",
    "evaluate",
    "expected_graphs",
    "main",
    "parallel_dims",
    "render",
    "run_rank",
    "run_row",
    "torchtitan_loss",
    "unsharded_loss",
]

LR = 1e-2


def _configs() -> dict[str, dict[str, Any]]:
    from ap_bucketing import BucketingConfig

    from zoo.run import AP_CONFIGS, BUCKET_FORM_CONFIGS

    return {
        **AP_CONFIGS,
        **BUCKET_FORM_CONFIGS,
        # diagnosis: bucketing without the overlap scheduler (reorder=False)
        "bucketing_no_overlap": {"enable_ac": True, "bucketing": BucketingConfig()},
    }


#: The ap configurations a row can run (``--config``; the rows use ``full``).
CONFIGS = _configs()


# ----------------------------------------------------------------------------------------------
# the loop


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return (t if to_local is None else to_local()).detach().clone()


@dataclass
class Loop:
    """What one run of the loop produced: every micro-batch loss, every evaluation loss and
    each step's accumulated gradient (this rank's local shards, by parameter name)."""

    losses: list[float] = field(default_factory=list)
    eval_losses: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    seconds: float = 0.0


def train(
    fn: Callable[..., torch.Tensor],
    params: Sequence[tuple[str, nn.Parameter]],
    row: Row,
    data: list[tuple[torch.Tensor, ...]],
    eval_batch: Any,
) -> Loop:
    """``row.steps`` SGD steps of ``row.micro`` accumulated micro-batches each, with a
    ``no_grad`` evaluation after every step but the last (``row.eval``)."""
    out = Loop()
    start = time.perf_counter()
    it = iter(data)
    for step in range(row.steps):
        for _ in range(row.micro):
            loss = fn(*next(it))
            (loss / row.micro).backward()  # type: ignore[no-untyped-call]
            out.losses.append(float(loss.detach()))
        with torch.no_grad():
            out.grads.append({n: _local(p.grad) for n, p in params if p.grad is not None})
            for _, p in params:
                if p.grad is not None:
                    p.sub_(LR * p.grad)
                    p.grad = None
        if row.eval and step < row.steps - 1:
            with torch.no_grad():
                out.eval_losses.append(float(fn(*eval_batch)))
    out.seconds = time.perf_counter() - start
    return out


def _rel(got: Loop, ref: Loop) -> tuple[float, float, str]:
    from zoo.run import _grads_rel, _loss_rel

    losses = got.losses + got.eval_losses
    ref_losses = ref.losses + ref.eval_losses
    loss_rel = _loss_rel(losses, ref_losses) if len(losses) == len(ref_losses) else math.inf
    grad_rel, where = _grads_rel(got.grads, ref.grads)
    return loss_rel, grad_rel, where


# ----------------------------------------------------------------------------------------------
# one rank


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return int(sum(counters["graph_break"].values()))


def run_rank(
    rank: int, world: int, name: str, config: str = "full", stock: bool = False
) -> dict[str, Any]:
    """One rank's row: eager, the full configuration, stock when asked; plain numbers back."""
    from ap_backend import autoparallel_backend, precompile
    from torch._dynamo.utils import counters

    from zoo.run import _State

    warnings.filterwarnings("ignore")
    row = ROWS[name]
    if world != row.world:
        raise ValueError(f"zoo.meshes: row {name} needs {row.world} ranks, got {world}")
    dims = parallel_dims(row)
    step = build(row, dims)
    params = list(step.named_parameters())
    data, eval_batch = batches(row, rank)
    state = _State(step)
    out: dict[str, Any] = {
        "rank": rank,
        "row": name,
        "model": row.model,
        "config": config,
        "n_params": len(params),
    }

    eager = train(step, params, row, data, eval_batch)
    out["eager_s"] = eager.seconds
    reference = unsharded_loss(row, data[0])
    out["mesh_vs_unsharded"] = abs(eager.losses[0] - reference) / abs(reference)
    out["losses_eager"] = eager.losses + eager.eval_losses

    state.restore()
    torch._dynamo.reset()
    counters.clear()
    start = time.perf_counter()
    pm = precompile(step, data[0])
    out["precompile_s"] = time.perf_counter() - start
    out["fsdp_chains"] = int(pm.fsdp_report.chains_found)
    state.restore()
    backend = autoparallel_backend(**CONFIGS[config])
    counting = count_pass(backend, axis_names(dims, row))
    ap = train(torch.compile(pm, backend=backend), params, row, data, eval_batch)
    out["ap_s"] = ap.seconds
    out["losses_ap"] = ap.losses + ap.eval_losses
    out["loss_rel"], out["grad_rel"], out["grad_worst"] = _rel(ap, eager)
    out["graph_breaks"] = _graph_breaks()
    out["graphs"] = len(backend.compile_seconds)
    out["backend_s"] = sum(backend.compile_seconds)
    out["fallbacks"] = sum(1 for r in backend.partition_reports if r.fell_back)
    out["fallback_reasons"] = [r.fallback_reason for r in backend.partition_reports if r.fell_back]
    out["partitions"] = len(backend.partition_reports)
    out["all_gather_saved"] = sum(len(s.all_gather_outputs) for s in backend.saved)
    out["all_gather_saved_names"] = [str(n) for s in backend.saved for n in s.all_gather_outputs]
    out["collectives"] = counting.reports if counting is not None else []

    if row.runs_stock or stock:
        state.restore()
        torch._dynamo.reset()
        counters.clear()
        plain = train(torch.compile(step), params, row, data, eval_batch)
        out["stock_loss_rel"], out["stock_grad_rel"], _ = _rel(plain, eager)
        out["stock_graph_breaks"] = _graph_breaks()
        out["stock_s"] = plain.seconds
    torch._dynamo.reset()
    return out


# ----------------------------------------------------------------------------------------------
# launching


def run_row(
    name: str, timeout_s: float = 1500.0, config: str = "full", stock: bool = False
) -> RowResult:
    """Spawn the row's ranks (gloo on 127.0.0.1) and combine them."""
    from ap_backend.demo import spawn_ranks

    start = time.perf_counter()
    ranks = spawn_ranks(run_rank, ROWS[name].world, name, config, stock, timeout_s=timeout_s)
    return combine(name, ranks, time.perf_counter() - start, "spawn")


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def _torchrun_rows(names: list[str], config: str, stock: bool) -> list[RowResult] | None:
    """This process is one torchrun rank: run every row, gather to rank 0 (``None`` elsewhere)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    results: list[RowResult] = []
    try:
        for name in names:
            start = time.perf_counter()
            mine = run_rank(rank, world, name, config, stock)
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, mine)
            results.append(combine(name, gathered, time.perf_counter() - start, "torchrun"))
    finally:
        dist.destroy_process_group()
    return results if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zoo.meshes", description=__doc__)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)}")
    parser.add_argument("--json", default=None, help="write the rows here too")
    parser.add_argument(
        "--config", default="full", help="the ap configuration (zoo.run.AP_CONFIGS; full)"
    )
    parser.add_argument("--stock", action="store_true", help="also stock torch.compile, any row")
    args = parser.parse_args(argv)
    names = [n for n in args.rows.split(",") if n]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    if _under_torchrun():
        results = _torchrun_rows(names, args.config, args.stock)
        if results is None:
            return 0
    else:
        results = []
        for name in names:
            print(f"[zoo.meshes] {name}: {ROWS[name].world} ranks ...", file=sys.stderr, flush=True)
            results.append(run_row(name, config=args.config, stock=args.stock))
    print(render(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump([r.to_dict() for r in results], fh, indent=1)
    return 0 if all(not evaluate(r) for r in results) else 1


if __name__ == "__main__":
    status = main()
    if _under_torchrun():  # a rank torchrun started: see zoo.teardown
        from zoo.teardown import exit_without_finalization

        exit_without_finalization(status)
    raise SystemExit(status)
