"""EP chunking of the zoo's MoE models through the backend (``python -m zoo.ep``).

A case: torchtitan's Qwen3-MoE or DeepSeek-V3 debug model, FSDP-wrapped like every zoo row,
compiled with ``autoparallel_backend(ep_chunk=ChunkConfig(("layers.*.moe",), num_chunks=N))``
through the documented token route: the token and target tensors are marked with
``ap_epchunk.mark_chunk_dim(t, 0, hint=None)`` and the first compiled call uses them. Two SGD
steps are compared with eager and with ``EagerChunked`` (every ``layers.*.moe`` run chunk by
chunk in eager), the numerical reference of chunking.

Two things differ from the ``default`` row of the same model, for reasons outside the models:

* the batch is ``EP_BATCH`` = 8 sequences (the zoo's 2 would make one-sequence chunks, which a
  static-size graph cannot tell apart from broadcasting);
* ``precompile`` runs inside ``annotate_module_fqns(model)``: ``FsdpTrainStep`` hides the model
  from ``named_modules()`` (it is not a submodule), and the chunk pass selects regions by the
  module FQNs that annotation records.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zoo.models import MODELS
from zoo.models._base import ZooModel, token_batches
from zoo.run import (
    _first_line,
    _grads_rel,
    _loss_rel,
    _rank_batches,
    _shard_params,
    _sharded_step,
    _State,
    _train,
)

__all__ = ["EP_BATCH", "EP_MODELS", "EpResult", "precompiled_ep_step", "run_ep_case"]

EP_MODELS = ("tt_qwen3_moe", "tt_deepseek_v3")
EP_BATCH = 8
PATTERN = "layers.*.moe"


@dataclass
class EpResult:
    model: str
    num_chunks: int
    regions_chunked: int = 0
    chunk_mode: str = ""
    mutation_chains: list[str] = field(default_factory=list)
    #: chunked backend vs eager / vs EagerChunked; EagerChunked vs eager (normwise, see zoo.run)
    loss_rel_eager: float | None = None
    grad_rel_eager: float | None = None
    loss_rel_eager_chunked: float | None = None
    grad_rel_eager_chunked: float | None = None
    eager_chunked_vs_eager_grad: float | None = None
    backend_s: float | None = None
    error: str | None = None


def precompiled_ep_step(
    model: str, rank: int
) -> tuple[Any, tuple[torch.Tensor, ...], list[tuple[str, nn.Parameter]], _State]:
    """Real-EP ``model`` (``zoo.models.expert_parallel``) for one step on this rank: its
    rank's batch of ``EP_BATCH`` sequences with every input's token dim marked for chunking
    (``mark_chunk_dim(t, 0, hint=None)``), precompiled under module-FQN annotation. Returns
    ``(precompiled module, batch, parameter shards, state to restore)``: what the EP overlap
    schedule's test and benchmark compile in their variants (``run_real_ep_case`` trains
    several steps and marks only when it chunks)."""
    from ap_backend import precompile
    from ap_epchunk import mark_chunk_dim
    from ap_tags import annotate_module_fqns

    from zoo.models.expert_parallel import EP_MODELS as BUILDERS
    from zoo.models.expert_parallel import cpu_expert_parallel

    cpu_expert_parallel()
    zm = BUILDERS[model](1)
    zm.batches = list(token_batches(1, batch=EP_BATCH))
    (batch,) = _rank_batches(zm, rank)
    step = _sharded_step(zm)
    for t in batch:
        mark_chunk_dim(t, 0, hint=None)
    with annotate_module_fqns(zm.module):
        pm = precompile(step, batch)
    return pm, batch, _shard_params(step), _State(step)


def _eager_chunked(zm: ZooModel, n: int) -> nn.Module:
    """A copy of the model with every ``layers.*.moe`` run chunk by chunk (``EagerChunked``;
    its parameters are named ``layers.<i>.moe.module.<p>``, see :func:`_unwrapped`)."""
    return _chunk_moe_layers(copy.deepcopy(zm.module), n)


def _chunk_moe_layers(model: nn.Module, n: int) -> nn.Module:
    """``model`` with every ``layers.*.moe`` replaced (in place) by ``EagerChunked(moe, 0, n)``."""
    from ap_epchunk import EagerChunked

    layers: Any = model.layers
    for layer in layers.values() if isinstance(layers, nn.ModuleDict) else layers:
        moe = getattr(layer, "moe", None)
        if isinstance(moe, nn.Module):
            layer.moe = EagerChunked(moe, 0, n)
    return model


def _unwrapped(grads: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    return [{k.replace(".moe.module.", ".moe."): v for k, v in g.items()} for g in grads]


def run_ep_case(model: str, num_chunks: int, steps: int = 2) -> EpResult:
    """One case in this process (torch.distributed initialised). Never raises for a model or
    backend failure: see ``EpResult.error``."""
    from ap_backend import autoparallel_backend, precompile
    from ap_epchunk import ChunkConfig, mark_chunk_dim
    from ap_tags import annotate_module_fqns

    res = EpResult(model, num_chunks)
    torch._dynamo.reset()
    try:
        zm = MODELS[model](steps)
        zm.batches = list(token_batches(steps, batch=EP_BATCH))
        ref_model = _eager_chunked(zm, max(num_chunks, 2))
        step = _sharded_step(zm)
        params = _shard_params(step)
        state = _State(step)
        ref_losses, ref_grads = _train(step, params, zm.batches)
        state.restore()
        ec_step = _sharded_step(zm, ref_model)
        ec_losses, ec_grads = _train(ec_step, _shard_params(ec_step), zm.batches)
        ec_grads = _unwrapped(ec_grads)
        for t in zm.batches[0]:  # the documented token route: mark, then compile on them
            mark_chunk_dim(t, 0, hint=None)
        with annotate_module_fqns(zm.module):
            pm = precompile(step, zm.batches[0])
        state.restore()
        # num_chunks=1: the unchunked backend on the same batch (the bf16 gap to compare with)
        chunk = ChunkConfig((PATTERN,), num_chunks=num_chunks) if num_chunks > 1 else None
        backend = autoparallel_backend(ep_chunk=chunk)
        compiled = torch.compile(pm, backend=backend)
        start = time.perf_counter()
        losses, grads = _train(compiled, params, zm.batches)
        res.backend_s = time.perf_counter() - start
        if backend.chunk_reports:
            report = backend.chunk_reports[-1]
            res.regions_chunked = len(report.regions)
            res.chunk_mode = report.mode
            res.mutation_chains = list(report.mutation_chains)
        res.loss_rel_eager = _loss_rel(losses, ref_losses)
        res.grad_rel_eager = _grads_rel(grads, ref_grads)[0]
        res.loss_rel_eager_chunked = _loss_rel(losses, ec_losses)
        res.grad_rel_eager_chunked = _grads_rel(grads, ec_grads)[0]
        res.eager_chunked_vs_eager_grad = _grads_rel(ec_grads, ref_grads)[0]
    except Exception as exc:  # noqa: BLE001 - recorded, like every zoo case
        res.error = _first_line(exc)
    finally:
        torch._dynamo.reset()
    return res


# ----------------------------------------------------------------------------------------------
# real expert parallelism (the default of ``python -m zoo.ep``)

REAL_EP_MODELS = ("tt_qwen3_moe_ep", "tt_deepseek_v3_ep")
REAL_EP_CONFIGS = ("default", "full")
REAL_EP_WORLD = 2


@dataclass
class RealEpResult:
    """One real-EP case, worst rank kept (see :func:`_merge_ranks`)."""

    model: str
    num_chunks: int
    config: str
    world: int = REAL_EP_WORLD
    #: bf16 experts (torchtitan's own): judged against stock Inductor's gap, not fp32 tolerances
    bf16: bool = False
    #: the token route: "static" (hint=None) or "hinted" (hint=the token extent)
    marks: str = "static"
    moe_layers: int = 0
    #: all_to_all_single in the partitioned forward / backward graphs handed to Inductor
    all_to_all_fw: int | None = None
    all_to_all_bw: int | None = None
    graphs: int | None = None
    graph_breaks: int | None = None
    loss_rel_eager: float | None = None
    grad_rel_eager: float | None = None
    stock_loss_rel: float | None = None
    stock_grad_rel: float | None = None
    loss_rel_eager_chunked: float | None = None
    grad_rel_eager_chunked: float | None = None
    compile_s: float | None = None
    regions_chunked: int = 0
    #: ChunkReport: all-to-alls in each chunked region's body (forward regions first, per layer)
    region_all_to_alls: list[int] = field(default_factory=list)
    #: ChunkReport: the collectives each region kept whole, with why
    whole_collectives: list[str] = field(default_factory=list)
    #: FSDP buckets ap-bucketing formed while the backend compiled, and the collectives in them
    #: (``BucketingStats`` summed over the forward and backward graphs; ``None``: no bucketing)
    buckets: int | None = None
    bucketed: int | None = None
    error: str | None = None


def _error_line(exc: BaseException) -> str:
    """The exception's first line, or for a wrapper whose first line says nothing (Dynamo's
    ``BackendCompilerFailed: backend=... raised:``) the wrapped error's."""
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    if len(lines) > 1 and lines[0].rstrip().endswith("raised:"):
        return f"{type(exc).__name__}: {lines[1]}"[:400]
    return _first_line(exc)


def _moe_layers(model: nn.Module) -> int:
    return sum(1 for name, _ in model.named_modules() if name.endswith(".moe"))


def _count_a2a(backend: Any, backward: bool) -> int:
    return sum(
        c["collectives"].get("all_to_all_single", 0)
        for c in backend.inner_compiles
        if c["is_backward"] == backward
    )


def run_real_ep_case(
    model: str,
    num_chunks: int,
    config: str,
    steps: int = 2,
    *,
    marks: str = "static",
    stock: bool = True,
) -> RealEpResult:
    """One case on this rank of an initialised ``REAL_EP_WORLD``-rank group: the model with its
    experts sharded over the ranks (``zoo.models.expert_parallel``), eager EP as the
    reference, stock ``torch.compile`` of the same step for its gap, then ``precompile`` + the
    backend in ``config`` (chunked into ``num_chunks`` when > 1). ``marks``: the token route,
    ``"static"`` (``mark_chunk_dim(t, 0, hint=None)``) or ``"hinted"`` (``hint=t.shape[0]``:
    the token dim is one unbacked symbol through precompile, Dynamo and the backend).
    ``stock=False`` skips the stock compile (its gap is the zoo table's and the bf16 rows'
    tolerance, not an fp32 test's): one compile of the model fewer. Never raises for a model
    or backend failure (``error``)."""
    import torch.distributed as dist
    from ap_backend import autoparallel_backend, precompile
    from ap_epchunk import ChunkConfig, mark_chunk_dim
    from ap_tags import annotate_module_fqns

    from zoo.models.expert_parallel import EP_MODELS as BUILDERS
    from zoo.models.expert_parallel import cpu_expert_parallel
    from zoo.run import BACKEND_CONFIGS, _rank_batches

    res = RealEpResult(model, num_chunks, config, world=dist.get_world_size(), marks=marks)
    stage = "build"
    torch._dynamo.reset()
    try:
        cpu_expert_parallel()
        zm = BUILDERS[model](steps)
        zm.batches = list(token_batches(steps, batch=EP_BATCH))
        res.moe_layers = _moe_layers(zm.module)
        res.bf16 = zm.bf16
        batches = _rank_batches(zm, dist.get_rank())
        step = _sharded_step(zm)
        params = _shard_params(step)
        state = _State(step)
        stage = "eager EP"
        ref_losses, ref_grads = _train(step, params, batches)
        state.restore()
        if num_chunks > 1:
            stage = "EagerChunked"
            # the same model built again (same seed) with each MoE layer run chunk by chunk:
            # every chunk routes and exchanges its own tokens, eagerly
            ec_zm = BUILDERS[model](steps)
            ec_step = _sharded_step(ec_zm, _chunk_moe_layers(ec_zm.module, num_chunks))
            ec_losses, ec_grads = _train(ec_step, _shard_params(ec_step), batches)
            ec_grads = _unwrapped(ec_grads)
        if stock:
            stage = "stock torch.compile"
            # torchtitan's setting for EP: the split sizes' .tolist() as unbacked symbols
            with torch._dynamo.config.patch(capture_scalar_outputs=True):
                stock_losses, stock_grads = _train(torch.compile(step), params, batches)
            res.stock_loss_rel = _loss_rel(stock_losses, ref_losses)
            res.stock_grad_rel = _grads_rel(stock_grads, ref_grads)[0]
            state.restore()
            torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        stage = "precompile"
        if num_chunks > 1:
            for t in batches[0]:
                mark_chunk_dim(t, 0, hint=None if marks == "static" else t.shape[0])
        with annotate_module_fqns(zm.module):
            pm = precompile(step, batches[0])
        state.restore()
        chunk = ChunkConfig((PATTERN,), num_chunks=num_chunks) if num_chunks > 1 else None
        backend = autoparallel_backend(ep_chunk=chunk, **BACKEND_CONFIGS[config])
        stage = f"backend ({config}, N={num_chunks})"
        start = time.perf_counter()
        losses, grads = _train(torch.compile(pm, backend=backend), params, batches)
        res.compile_s = time.perf_counter() - start
        if backend.bucketing_stats:
            res.buckets = sum(s.buckets for s in backend.bucketing_stats)
            res.bucketed = sum(s.bucketed for s in backend.bucketing_stats)
        counters = torch._dynamo.utils.counters
        res.graphs = int(counters["stats"]["unique_graphs"])
        res.graph_breaks = sum(counters["graph_break"].values())
        res.all_to_all_fw = _count_a2a(backend, backward=False)
        res.all_to_all_bw = _count_a2a(backend, backward=True)
        if backend.chunk_reports:
            regions = backend.chunk_reports[-1].regions
            res.regions_chunked = len(regions)
            res.region_all_to_alls = [r.all_to_alls for r in regions]
            res.whole_collectives = sorted({w for r in regions for w in r.whole_collectives})
        res.loss_rel_eager = _loss_rel(losses, ref_losses)
        res.grad_rel_eager = _grads_rel(grads, ref_grads)[0]
        if num_chunks > 1:
            res.loss_rel_eager_chunked = _loss_rel(losses, ec_losses)
            res.grad_rel_eager_chunked = _grads_rel(grads, ec_grads)[0]
    except Exception as exc:  # noqa: BLE001 - recorded, like every zoo case
        res.error = f"{stage}: {_error_line(exc)}"
    finally:
        torch._dynamo.reset()
    return res


def _merge_ranks(results: list[RealEpResult]) -> RealEpResult:
    """One row per case: the first error, else each error measure's worst rank."""
    merged = dataclasses.replace(results[0])
    for other in results[1:]:
        if merged.error is None and other.error is not None:
            merged.error = other.error
        for f in dataclasses.fields(RealEpResult):
            if f.name.endswith("_rel") or "_rel_" in f.name:
                a, b = getattr(merged, f.name), getattr(other, f.name)
                if b is not None and (a is None or b > a):
                    setattr(merged, f.name, b)
    return merged


def _real_ep_rank(
    rank: int,
    world: int,
    port: int,
    cases: list[tuple[str, int, str]],
    out: str,
    marks: str,
    stock: bool = True,
) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = [
            dataclasses.asdict(run_real_ep_case(m, n, c, marks=marks, stock=stock))
            for m, n, c in cases
        ]
    finally:
        dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(rows, f)


def run_real_ep(
    cases: list[tuple[str, int, str]],
    *,
    world: int = REAL_EP_WORLD,
    port: int = 29630,
    marks: str = "static",
    stock: bool = True,
) -> list[RealEpResult]:
    """Spawn ``world`` gloo ranks on 127.0.0.1, run ``cases`` (model, chunks, config) on each,
    and merge the ranks' results (``stock``: :func:`run_real_ep_case`'s)."""
    from pathlib import Path

    import torch.multiprocessing as mp

    # the spawned ranks unpickle zoo.ep._real_ep_rank: they take this process's sys.path
    # (multiprocessing's spawn preparation), which under pytest's importlib mode lacks the root
    root = str(Path(__file__).resolve().parent.parent)
    added = root not in sys.path
    if added:
        sys.path.insert(0, root)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = f"{tmp}/rows"
            mp.spawn(_real_ep_rank, args=(world, port, cases, out, marks, stock), nprocs=world)  # type: ignore[attr-defined,no-untyped-call]
            per_rank = _read_ranks(out, world)
    finally:
        if added:
            sys.path.remove(root)
    return [_merge_ranks(list(rows)) for rows in zip(*per_rank, strict=True)]


def _read_ranks(out: str, world: int) -> list[list[RealEpResult]]:
    per_rank = []
    for rank in range(world):
        with open(f"{out}.{rank}") as f:
            per_rank.append([RealEpResult(**row) for row in json.load(f)])
    return per_rank


def real_ep_tolerance(r: RealEpResult) -> tuple[float, float]:
    """(loss, grad) tolerance of a real-EP row: 1e-5 / 1e-4 with fp32 experts; with bf16
    experts stock Inductor's own gap on the same model in the same run (never below those),
    as the zoo judges its bf16 models (``zoo.run.numerics_tolerance``)."""
    if not r.bf16:
        return 1e-5, 1e-4
    loss = r.stock_loss_rel if r.stock_loss_rel is not None else 0.0
    grad = r.stock_grad_rel if r.stock_grad_rel is not None else 0.0
    return max(loss, 1e-5), max(grad, 1e-4)


def render_real_ep(rows: list[RealEpResult], *, load: str = "") -> str:
    """The markdown table ``python -m zoo.ep --write`` puts in ``zoo/RESULTS.md``."""
    out = [
        "| model | N | config | a2a / MoE layer fw | a2a / MoE layer bw | graphs (breaks) | "
        "loss / grad rel vs eager EP | vs EagerChunked | stock loss / grad rel | compile + 2 steps s |"
        " status |",
        "|---|---:|---|---:|---:|---|---|---|---|---:|---|",
    ]

    def rel(a: float | None, b: float | None) -> str:
        return "-" if a is None or b is None else f"{a:.1e} / {b:.1e}"

    for r in rows:
        layers = max(r.moe_layers, 1)
        fw = "-" if r.all_to_all_fw is None else f"{r.all_to_all_fw / layers:g}"
        bw = "-" if r.all_to_all_bw is None else f"{r.all_to_all_bw / layers:g}"
        graphs = "-" if r.graphs is None else f"{r.graphs} ({r.graph_breaks})"
        loss_tol, grad_tol = real_ep_tolerance(r)
        ok = r.error is None and all(
            v is not None and v <= tol
            for v, tol in (
                (r.loss_rel_eager, loss_tol),
                (r.grad_rel_eager, grad_tol),
                (r.loss_rel_eager_chunked if r.num_chunks > 1 else 0.0, loss_tol),
                (r.grad_rel_eager_chunked if r.num_chunks > 1 else 0.0, grad_tol),
            )
        )
        status = "ok" if ok else (r.error or "numerics")
        compile_s = "-" if r.compile_s is None else f"{r.compile_s:.1f}"
        out.append(
            f"| {r.model} | {r.num_chunks} | {r.config} | {fw} | {bw} | {graphs} | "
            f"{rel(r.loss_rel_eager, r.grad_rel_eager)} | "
            f"{rel(r.loss_rel_eager_chunked, r.grad_rel_eager_chunked)} | "
            f"{rel(r.stock_loss_rel, r.stock_grad_rel)} | {compile_s} | {status} |"
        )
    if load:
        out.append(f"\n{load}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    parser = argparse.ArgumentParser(prog="python -m zoo.ep", description=__doc__)
    parser.add_argument("--models", default=",".join(EP_MODELS))
    parser.add_argument("--chunks", default="1,2,4", help="1: the unchunked backend")
    parser.add_argument("--configs", default=",".join(REAL_EP_CONFIGS))
    parser.add_argument(
        "--marks",
        choices=("static", "hinted"),
        default="static",
        help="token route: mark_chunk_dim(t, 0, hint=None) (static) or hint=t.shape[0]",
    )
    parser.add_argument(
        "--local-experts",
        action="store_true",
        help="the MoE models without EP (every expert on the one rank), as before real EP",
    )
    args = parser.parse_args(argv)
    if not args.local_experts:
        models = args.models if args.models != ",".join(EP_MODELS) else ",".join(REAL_EP_MODELS)
        cases = [
            (m, int(n), c)
            for m in models.split(",")
            for n in args.chunks.split(",")
            for c in args.configs.split(",")
        ]
        rows = run_real_ep(cases, marks=args.marks)
        for row in rows:
            print(json.dumps(dataclasses.asdict(row)), flush=True)
        print(render_real_ep(rows))
        return 0
    with tempfile.NamedTemporaryFile() as f:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore(f.name, 1))  # type: ignore[attr-defined]
        try:
            for name in args.models.split(","):
                for n in (int(c) for c in args.chunks.split(",")):
                    print(json.dumps(dataclasses.asdict(run_ep_case(name, n))), flush=True)
        finally:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
