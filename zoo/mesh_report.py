"""What ``zoo.meshes`` measures and how it judges a row: each compiled graph's collectives per
mesh axis before -> after the bucketing pass (:class:`GroupCounting`), a row over its ranks
(:class:`RowResult`), the verdict (:func:`evaluate`) and the table (:func:`render`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from zoo.mesh_models import ROWS, Row
from zoo.verdict import FP32_GRAD_RTOL, FP32_RTOL

__all__ = [
    "BF16_MULTIPLIER",
    "GRAD_RTOL",
    "LOSS_RTOL",
    "GroupCounting",
    "RowResult",
    "bucketed_axes",
    "combine",
    "count_pass",
    "evaluate",
    "expected_graphs",
    "render",
]

#: fp32 numerics criteria of issue #23 (loss, gradients), against eager: the zoo's own.
LOSS_RTOL = FP32_RTOL
GRAD_RTOL = FP32_GRAD_RTOL
#: bf16: the compiled run's gap to eager may be at most this many times stock's.
BF16_MULTIPLIER = 2.0

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


def axis_names(dims: Any, row: Row) -> dict[str, str]:
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


def count_pass(backend: Any, names: dict[str, str]) -> GroupCounting | None:
    key = "post_grad_custom_post_pass"
    patches = backend._persistent_patches
    if patches.get(key) is None:
        return None
    counting = GroupCounting(patches[key], names)
    patches[key] = counting
    return counting


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
    #: which model (``zoo.mesh_models.MESH_MODELS``); records before 2026-11-26 are Llama3's
    model: str = "tt_llama3"

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
        model=row.model,
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
    # fp32 parameters (bf16 inside the model too: Qwen3-MoE's grouped experts, 8.5e-7 on
    # fsdp x tp): the mesh's eager first loss is the unsharded model's
    if not row.bf16 and res.mesh_vs_unsharded > LOSS_RTOL:
        problems.append("eager mesh loss != unsharded model's")
    if row.bf16_judged:
        if res.stock_loss_rel is None or res.stock_grad_rel is None:
            problems.append("no stock gap to judge bf16 against")
        else:
            if res.loss_rel > BF16_MULTIPLIER * max(res.stock_loss_rel, LOSS_RTOL):
                problems.append("loss beyond 2x stock's gap")
            if res.grad_rel > BF16_MULTIPLIER * max(res.stock_grad_rel, GRAD_RTOL):
                problems.append("grads beyond 2x stock's gap")
    else:
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
