"""The meshes and training loops users train with (issue #23, item 2): ``python -m zoo.meshes``.

Each *row* is torchtitan's Llama3 debug model (``zoo.models.torchtitan_models.llama3``: 2
layers, dim 64) parallelised by torchtitan 0.3.0's own graph-trainer path -- a
``ParallelDims`` mesh (``build_mesh``), ``model.parallelize(parallel_dims)`` for tensor
parallelism (torchtitan's Llama3 sharding config: fused QKV and ``w1``/``w3`` colwise,
``wo``/``w2`` rowwise, vocabulary-sharded embedding and LM head), then
``graph_trainer.common_utils.apply_simple_fsdp`` (SimpleFSDP: ``fully_shard`` on the ``fsdp``
axis, ``hybrid_shard`` on ``(dp_replicate, fsdp)``, with the ``MixedPrecisionPolicy`` of the
``TrainingConfig``) -- trained eagerly, then through ``precompile`` +
``torch.compile(backend=autoparallel_backend(enable_ac=True, bucketing=True,
overlap_scheduling=True))`` (the full configuration) on the same rank's batches, and compared:

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
1e-5, gradients 1e-4. Structure: zero ap-partitioner fallbacks, no Dynamo graph break, the
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
from dataclasses import asdict, dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

__all__ = [
    "GRAD_RTOL",
    "LOSS_RTOL",
    "ROWS",
    "BF16_MULTIPLIER",
    "Row",
    "evaluate",
    "main",
    "render",
    "run_rank",
    "run_row",
]

#: fp32 numerics criteria of issue #23 (loss, gradients), against eager.
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
#: bf16: the compiled run's gap to eager may be at most this many times stock's.
BF16_MULTIPLIER = 2.0
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


@dataclass(frozen=True)
class Row:
    """One mesh x loop: ``dp_replicate`` x ``dp_shard`` x ``tp`` ranks, ``micro`` micro-batches
    per step, ``steps`` optimizer steps, a ``no_grad`` evaluation between steps (``eval``),
    bf16 parameters (``bf16``: ``MixedPrecisionPolicy(bf16, fp32)``, also runs stock)."""

    name: str
    dp_replicate: int = 1
    dp_shard: int = 2
    tp: int = 1
    micro: int = 1
    steps: int = 2
    eval: bool = False
    bf16: bool = False
    stock: bool = False

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def mesh(self) -> str:
        axes = [("dp_replicate", self.dp_replicate), ("fsdp", self.dp_shard), ("tp", self.tp)]
        return " x ".join(f"{n} {d}" for n, d in axes if d > 1)


ROWS: dict[str, Row] = {
    r.name: r
    for r in (
        Row("accum_eval", micro=2, eval=True),
        Row("bf16", bf16=True, stock=True),
        Row("hsdp_2x2", dp_replicate=2, steps=1),
        Row("fsdp_tp_2x2", tp=2, steps=1),
    )
}


# ----------------------------------------------------------------------------------------------
# the model on the mesh


def torchtitan_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """torchtitan's trainer loss (``components.loss.cross_entropy_loss``: fp32, sum reduction;
    on vocabulary-sharded TP logits its loss-parallel ``_LossParallelCrossEntropy``) over the
    token count: the mean next-token loss."""
    from torchtitan.components.loss import cross_entropy_loss

    out: torch.Tensor = cross_entropy_loss(logits, targets) / targets.numel()
    return out


class _LossOf(nn.Module):
    """The parallelised model and torchtitan's loss as one module (what is compiled)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torchtitan_loss(self.model(tokens), targets)


def parallel_dims(row: Row) -> Any:
    """torchtitan's ``ParallelDims`` for ``row``, its mesh built on CPU."""
    from torchtitan.distributed.parallel_dims import ParallelDims

    from zoo.models.expert_parallel import cpu_expert_parallel

    cpu_expert_parallel()
    dims = ParallelDims(
        dp_replicate=row.dp_replicate,
        dp_shard=row.dp_shard,
        cp=1,
        tp=row.tp,
        pp=1,
        ep=1,
        world_size=row.world,
        spmd_backend="partial_dtensor",
    )
    dims.build_mesh()
    return dims


def build(row: Row, dims: Any) -> tuple[_LossOf, Any]:
    """The Llama3 debug model (seed 0) on ``dims``: TP by torchtitan's sharding config when
    ``row.tp > 1``, then torchtitan's ``apply_simple_fsdp``; and the zoo model."""
    from torchtitan.config import TrainingConfig
    from torchtitan.experiments.graph_trainer.common_utils import apply_simple_fsdp

    from zoo.models.torchtitan_models import llama3

    zm = llama3(1, tp_plan=row.tp > 1)
    model = zm.module
    if row.tp > 1:
        model.parallelize(dims)  # type: ignore[operator]
    training = TrainingConfig(
        mixed_precision_param="bfloat16" if row.bf16 else "float32",
        mixed_precision_reduce="float32",
    )
    model = apply_simple_fsdp(model, parallel_dims=dims, training=training)
    return _LossOf(model), zm


def unsharded_loss(batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    """The same model (seed 0) unparallelised, fp32, on ``batch``: what a correct mesh's first
    loss equals (up to fp32 round-off), independent of eager-vs-compiled."""
    from zoo.models.torchtitan_models import llama3

    with torch.no_grad():
        return float(torchtitan_loss(llama3(1).module(batch[0]), batch[1]))


def _dp_index(row: Row, rank: int) -> int:
    """Which data-parallel replica ``rank`` is (the TP ranks of one replica share its data;
    torchtitan's mesh puts ``tp`` innermost)."""
    return rank // row.tp


def batches(row: Row, rank: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], Any]:
    """This rank's micro-batches (``steps * micro``, in order) and the evaluation batch."""
    from zoo.models._base import token_batches

    data = token_batches(row.steps * row.micro + 1, seed=1000 + _dp_index(row, rank))
    return data[:-1], data[-1]


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
    data: list[tuple[torch.Tensor, torch.Tensor]],
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
# collectives by process group, before -> after the bucketing pass

_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def _group_of(node: torch.fx.Node, names: dict[str, str]) -> str | None:
    found: list[str] = []

    def visit(arg: Any) -> Any:
        if isinstance(arg, str) and arg in names:
            found.append(names[arg])
        return arg

    torch.fx.node.map_aggregate((node.args, node.kwargs), visit)
    return found[0] if found else None


def _collectives(
    graph: torch.fx.Graph, names: dict[str, str]
) -> list[tuple[torch.fx.Node, str, str]]:
    """``(node, mesh axis, kind)`` of every functional collective ``graph`` issues (a bucket is
    one collective; torch's ``bucketing._pre_bucket_*`` copies are not collectives), waits
    excluded; a group not on the mesh is axis ``other``."""
    found = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        target = str(node.target)
        if not target.startswith("_c10d_functional.") or "wait" in target:
            continue
        kind = next((k for k in _KINDS if k in target), None)
        if kind is not None:
            found.append((node, _group_of(node, names) or "other", kind))
    return found


def _by_group(graph: torch.fx.Graph, names: dict[str, str]) -> dict[str, dict[str, int]]:
    """``{mesh axis: {kind: count}}`` of :func:`_collectives`."""
    counts: dict[str, dict[str, int]] = {}
    for _, axis, kind in _collectives(graph, names):
        per = counts.setdefault(axis, dict.fromkeys(_KINDS, 0))
        per[kind] += 1
    return counts


def _unused(node: torch.fx.Node) -> bool:
    """A collective whose result nothing reads (its waits, if any, have no users)."""
    return all(not user.users for user in node.users)


class GroupCounting:
    """Wraps the backend's post-grad bucketing pass: records every graph's collectives per
    mesh axis before and after it (``reports``), then is the pass itself (same ``uuid``)."""

    def __init__(self, inner: Any, names: dict[str, str]) -> None:
        self.inner = inner
        self.names = names
        self.reports: list[dict[str, Any]] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        before = _by_group(graph, self.names)
        old = {
            n.name: (axis, kind, _unused(n)) for n, axis, kind in _collectives(graph, self.names)
        }
        self.inner(graph)
        after = _by_group(graph, self.names)
        new = _collectives(graph, self.names)
        # per axis: collectives the pass created (bucket merges), and the ones it removed,
        # split into those whose result was read and those nothing read (dead code)
        changes: dict[str, dict[str, int]] = {}
        for n, axis, _ in new:
            if n.name not in old:
                changes.setdefault(axis, {"created": 0, "removed_read": 0, "removed_unused": 0})[
                    "created"
                ] += 1
        kept = {n.name for n, _, _ in new}
        for name, (axis, _, unused) in old.items():
            if name not in kept:
                per = changes.setdefault(
                    axis, {"created": 0, "removed_read": 0, "removed_unused": 0}
                )
                per["removed_unused" if unused else "removed_read"] += 1
        self.reports.append({"before": before, "after": after, "changes": changes})

    def uuid(self) -> Any:
        return self.inner.uuid()


def _axis_names(dims: Any, row: Row) -> dict[str, str]:
    """Process-group name -> mesh axis, for every axis of ``row``'s mesh."""
    names: dict[str, str] = {}
    for axis, degree in (
        ("dp_replicate", row.dp_replicate),
        ("fsdp", row.dp_shard),
        ("tp", row.tp),
    ):
        if degree > 1:
            names[dims.get_mesh(axis).get_group().group_name] = axis
    return names


def _count_pass(backend: Any, names: dict[str, str]) -> GroupCounting | None:
    key = "post_grad_custom_post_pass"
    patches = backend._persistent_patches
    if patches.get(key) is None:
        return None
    counting = GroupCounting(patches[key], names)
    patches[key] = counting
    return counting


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
    step, zm = build(row, dims)
    params = list(step.named_parameters())
    data, eval_batch = batches(row, rank)
    state = _State(step)
    out: dict[str, Any] = {"rank": rank, "row": name, "config": config, "n_params": len(params)}

    eager = train(step, params, row, data, eval_batch)
    out["eager_s"] = eager.seconds
    reference = unsharded_loss(data[0])
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
    counting = _count_pass(backend, _axis_names(dims, row))
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

    if row.stock or stock:
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
# rows, the verdict, the table


@dataclass
class RowResult:
    """A row over all its ranks: numerics are the worst rank's, structure rank 0's."""

    row: str
    mesh: str
    ranks: int
    config: str
    micro: int
    steps: int
    eval: bool
    bf16: bool
    loss_rel: float
    grad_rel: float
    grad_worst: str
    mesh_vs_unsharded: float
    stock_loss_rel: float | None
    stock_grad_rel: float | None
    graph_breaks: int
    stock_graph_breaks: int | None
    graphs: int
    fallbacks: int
    all_gather_saved: int
    fsdp_chains: int
    n_params: int
    collectives: list[dict[str, Any]]
    seconds: dict[str, float]
    wall_s: float = 0.0
    launcher: str = "spawn"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def combine(name: str, ranks: list[dict[str, Any]], wall_s: float, launcher: str) -> RowResult:
    row = ROWS[name]
    r0 = ranks[0]

    def worst(key: str) -> float:
        return max(float(r[key]) for r in ranks)

    return RowResult(
        row=name,
        mesh=row.mesh,
        ranks=len(ranks),
        config=str(r0["config"]),
        micro=row.micro,
        steps=row.steps,
        eval=row.eval,
        bf16=row.bf16,
        loss_rel=worst("loss_rel"),
        grad_rel=worst("grad_rel"),
        grad_worst=max(ranks, key=lambda r: r["grad_rel"])["grad_worst"],
        mesh_vs_unsharded=worst("mesh_vs_unsharded"),
        stock_loss_rel=worst("stock_loss_rel") if "stock_loss_rel" in r0 else None,
        stock_grad_rel=worst("stock_grad_rel") if "stock_grad_rel" in r0 else None,
        graph_breaks=int(worst("graph_breaks")),
        stock_graph_breaks=int(worst("stock_graph_breaks")) if "stock_s" in r0 else None,
        graphs=int(r0["graphs"]),
        fallbacks=int(worst("fallbacks")),
        all_gather_saved=int(worst("all_gather_saved")),
        fsdp_chains=int(r0["fsdp_chains"]),
        n_params=int(r0["n_params"]),
        collectives=r0["collectives"],
        seconds={
            k: round(max(float(r[k]) for r in ranks), 2)
            for k in ("eager_s", "precompile_s", "backend_s", "ap_s", "stock_s")
            if k in r0
        },
        wall_s=round(wall_s, 1),
        launcher=launcher,
    )


def expected_graphs(row: Row) -> int:
    """Graphs the backend should compile: one training graph for every micro-batch and step,
    plus one inference graph for the ``no_grad`` evaluation."""
    return 1 + (1 if row.eval else 0)


def bucketed_axes(res: RowResult) -> dict[str, dict[str, tuple[int, int]]]:
    """Per mesh axis and kind: (collectives before, after) the bucketing pass, summed over the
    compiled graphs."""
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for rep in res.collectives:
        for axis in set(rep["before"]) | set(rep["after"]):
            b = rep["before"].get(axis, {})
            a = rep["after"].get(axis, {})
            per = out.setdefault(axis, {})
            for kind in _KINDS:
                pb, pa = per.get(kind, (0, 0))
                per[kind] = (pb + b.get(kind, 0), pa + a.get(kind, 0))
    return out


def evaluate(res: RowResult) -> list[str]:
    """The row's failed properties (empty: ok)."""
    row = ROWS[res.row]
    problems: list[str] = []
    if row.bf16:
        assert res.stock_loss_rel is not None and res.stock_grad_rel is not None
        if res.loss_rel > BF16_MULTIPLIER * max(res.stock_loss_rel, LOSS_RTOL):
            problems.append("loss beyond 2x stock's gap")
        if res.grad_rel > BF16_MULTIPLIER * max(res.stock_grad_rel, GRAD_RTOL):
            problems.append("grads beyond 2x stock's gap")
    else:
        if res.mesh_vs_unsharded > LOSS_RTOL:
            problems.append("eager mesh loss != unsharded model's")
        if res.loss_rel > LOSS_RTOL:
            problems.append("loss")
        if res.grad_rel > GRAD_RTOL:
            problems.append("grads")
    if res.fallbacks:
        problems.append("fallbacks")
    if res.graph_breaks > (res.stock_graph_breaks or 0):
        problems.append("graph breaks")
    if res.graphs != expected_graphs(row):
        problems.append(f"{res.graphs} graphs (expected {expected_graphs(row)})")
    if res.all_gather_saved:
        problems.append("all-gather outputs saved")
    axes = bucketed_axes(res)
    fsdp = axes.get("fsdp", {})
    if fsdp.get("reduce_scatter", (0, 0))[0] and not (
        fsdp["reduce_scatter"][1] < fsdp["reduce_scatter"][0]
    ):
        problems.append("fsdp reduce-scatters not bucketed")
    replicate = axes.get("dp_replicate", {}).get("all_reduce", (0, 0))
    if replicate[0] > 1 and not replicate[1] < replicate[0]:
        problems.append("dp_replicate gradient all-reduces not bucketed")
    for axis in ("tp", "other"):
        for kind, (before, after) in axes.get(axis, {}).items():
            if before != after:
                problems.append(f"{axis} {kind} changed {before} -> {after}")
    return problems


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.1e}"


def _axes_cell(res: RowResult) -> str:
    parts = []
    for axis, per in sorted(bucketed_axes(res).items()):
        kinds = [f"{k.replace('_', '-')} {b}->{a}" for k, (b, a) in per.items() if b or a]
        if kinds:
            parts.append(f"{axis}: {', '.join(kinds)}")
    return "; ".join(parts)


def render(results: list[RowResult]) -> str:
    head = (
        "| row | mesh (ranks) | loop | loss rel | grad rel | stock loss / grad rel | graphs "
        "| graph breaks (ap / stock) | fallbacks | collectives before->after bucketing "
        "| wall s | verdict |\n|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---|"
    )
    lines = [head]
    for r in results:
        loop = f"{r.steps} steps x {r.micro} micro" + (", no_grad eval" if r.eval else "")
        loop += ", bf16 params" if r.bf16 else ""
        stock = (
            f"{_fmt(r.stock_loss_rel)} / {_fmt(r.stock_grad_rel)}"
            if r.stock_loss_rel is not None
            else "—"
        )
        problems = evaluate(r)
        breaks = (
            f"{r.graph_breaks} / {'—' if r.stock_graph_breaks is None else r.stock_graph_breaks}"
        )
        lines.append(
            f"| `{r.row}`{'' if r.config == 'full' else f' ({r.config})'} | {r.mesh} ({r.ranks}) | {loop} | {_fmt(r.loss_rel)} | "
            f"{_fmt(r.grad_rel)} | {stock} | {r.graphs} | {breaks} | {r.fallbacks} | "
            f"{_axes_cell(r)} | {r.wall_s} | "
            f"{'**ok**' if not problems else ', '.join(problems)} |"
        )
    return "\n".join(lines)


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
    raise SystemExit(main())
