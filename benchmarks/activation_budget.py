"""Activation budget sweep (issue #25): saved bytes vs recompute FLOPs, ours vs torch's.

``uv run python -m benchmarks.activation_budget [--layers 8] [--points 5] [--plot DIR]``

One process, 1 rank, CPU, the zoo's real models called the ordinary way (torchtitan's Llama3 at
``--layers`` and HuggingFace's Llama, loss inside the step): ``precompile`` once, then the
second compilation with each partition policy. Every partition is measured on the graphs it
produced, the same way for every policy:

* **saved bytes**: the forward's saved activation storages (``ap_tags.counting``);
* **recompute FLOPs**: the backward graph's FLOPs (``torch.utils.flop_counter`` formulas per
  node, hinted shapes) minus the backward FLOPs of the replay without a budget -- what the
  policy added to the backward.

Policies: ours (``SaveAllPartitioner(activation_budget_bytes=B)`` for ``--points`` budgets from
the floor to the replay's bytes); torch's min-cut with ``activation_memory_budget`` = the same
fractions of its own saved bytes, for each solver torch ships with a fraction to sweep
(:data:`SOLVERS`; ``ilp`` needs scipy, in the dev group); ours again at each saved-bytes value
a torch solver reached (the comparison at matched saved bytes, ``matched_table``); ap-tags' AC staging tags (``enable_ac=True``) at a few stage sizes, cut by torch's min-cut (the
tags' ``PREFER_RECOMPUTE`` is what min-cut acts on; the replay only adds saves for them).
Compiles run the forward and backward once (numerics are the tests' business,
``tests/test_activation_budget.py``). Prints a markdown table; ``--plot DIR`` writes
``activation_budget_<model>.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import ap_backend
import ap_partitioner
import torch
import torch.fx
from ap_partitioner._budget import node_cost
from ap_partitioner._compat import CustomPartitionerFn
from ap_tags.counting import count_saved
from ap_testing.errors import raised

os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")


@dataclass
class Point:
    model: str
    policy: str
    setting: str
    saved_bytes: int
    backward_flops: int
    backward_bytes_moved: int = 0
    recompute_flops: int = 0
    recompute_bytes_moved: int = 0
    compile_s: float = 0.0


class Measured(CustomPartitionerFn):  # type: ignore[misc]
    """Delegates to ``inner``; records the forward's saved bytes and the backward's FLOPs."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.saved_bytes = 0
        self.backward_flops = 0
        self.backward_bytes_moved = 0

    def __call__(self, gm: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        fw, bw = self.inner(gm, joint_inputs, **kwargs)
        self.saved_bytes += count_saved(fw, int(kwargs["num_fwd_outputs"])).nbytes
        costs = [node_cost(n) for n in bw.graph.nodes]
        self.backward_flops += sum(c[0] for c in costs)
        self.backward_bytes_moved += sum(c[1] for c in costs)
        return fw, bw

    def uuid(self) -> str:
        return f"measured:{self.inner.uuid()}:{id(self)}"


@contextlib.contextmanager
def _functorch(**values: Any) -> Iterator[None]:
    cfg = torch._functorch.config
    old = {k: getattr(cfg, k) for k in values}
    for k, v in values.items():
        setattr(cfg, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(cfg, k, v)


class _Step(torch.nn.Module):
    """A zoo model and its loss as one module, called the ordinary way (by keyword where the
    zoo model names its inputs)."""

    def __init__(self, zm: Any) -> None:
        super().__init__()
        self.model = zm.module
        self._zm = zm

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        args, kwargs, rest = self._zm.split(batch)
        loss: torch.Tensor = self._zm.loss_fn(self.model(*args, **kwargs), *rest)
        return loss


def _models(layers: int) -> dict[str, Callable[[], tuple[torch.nn.Module, tuple[Any, ...]]]]:
    from zoo.models import hf_models, torchtitan_models

    def step_of(zm: Any) -> tuple[torch.nn.Module, tuple[Any, ...]]:
        return _Step(zm), zm.batches[0]

    return {
        f"tt_llama3_{layers}l": lambda: step_of(torchtitan_models.llama3(1, n_layers=layers)),
        "hf_llama": lambda: step_of(hf_models.llama(1)),
    }


def _compile_once(pm: Any, batch: Sequence[Any], partitioner: Any, **options: Any) -> float:
    torch.compiler.reset()
    backend = ap_backend.autoparallel_backend(partitioner=partitioner, **options)
    start = time.perf_counter()
    loss = torch.compile(pm, backend=backend)(*batch)
    loss.backward()
    return time.perf_counter() - start


def _measure(
    name: str, pm: Any, batch: Sequence[Any], policy: str, setting: str, inner: Any, **opts: Any
) -> Point:
    part = Measured(inner)
    seconds = _compile_once(pm, batch, part, **opts)
    return Point(
        name,
        policy,
        setting,
        part.saved_bytes,
        part.backward_flops,
        part.backward_bytes_moved,
        compile_s=seconds,
    )


def _floor(pm: Any, batch: Sequence[Any]) -> int:
    try:
        _compile_once(pm, batch, ap_partitioner.SaveAllPartitioner(activation_budget_bytes=0))
    except Exception as exc:  # Dynamo wraps the BudgetError
        cause = raised(exc, ap_partitioner.BudgetError)
        if cause is not None:
            return cause.floor
        raise
    return 0


#: torch 2.15's knapsack solvers for ``activation_memory_budget`` (``_functorch.partitioners.
#: _optimize_runtime_with_given_memory``); ``ilp`` needs scipy. ``dynamic_memory_budget_dp``
#: (experimental) picks its own knee-point budget, so it has no fraction to sweep: not run.
SOLVERS = ("dp", "greedy", "ilp", "dp_knapsack_sliding_hirschberg")


def _ours(name: str, pm: Any, batch: Sequence[Any], policy: str, budget: int) -> Point:
    return _measure(
        name,
        pm,
        batch,
        policy,
        f"{budget:,} B",
        ap_partitioner.SaveAllPartitioner(activation_budget_bytes=budget),
    )


def sweep(name: str, build: Callable[[], Any], points: int, matched: bool = True) -> list[Point]:
    """Ours at ``points`` budgets from the floor to the replay; each torch solver at the same
    fractions; the AC tags; and, with ``matched``, ours again at every saved-bytes value a
    torch solver reached inside our range (the comparison at matched saved bytes)."""
    torch.manual_seed(0)
    module, batch = build()
    pm = ap_backend.precompile(module, batch)
    replay = _measure(name, pm, batch, "replay", "-", ap_partitioner.SaveAllPartitioner())
    floor = _floor(pm, batch)
    out = [replay]
    fractions = [i / (points - 1) for i in range(points)]
    for f in fractions:
        out.append(_ours(name, pm, batch, "ours", int(floor + f * (replay.saved_bytes - floor))))
    solvers = [s for s in SOLVERS if s != "ilp" or _has_scipy()]
    for solver in solvers:
        for f in fractions:
            with _functorch(activation_memory_budget=f, activation_memory_budget_solver=solver):
                out.append(
                    _measure(
                        name,
                        pm,
                        batch,
                        f"torch {solver}",
                        f"{f:.2f}",
                        ap_partitioner.MinCutPartitioner(),
                    )
                )
    if matched:
        reached = sorted(
            {
                p.saved_bytes
                for p in out
                if p.policy.startswith("torch ") and floor < p.saved_bytes < replay.saved_bytes
            }
        )
        for budget in reached:
            out.append(_ours(name, pm, batch, "ours @ torch's bytes", budget))
    for size in ("auto", 0.0001, 0.001):
        out.append(
            _measure(
                name,
                pm,
                batch,
                "AC tags + min-cut",
                str(size),
                ap_partitioner.MinCutPartitioner(),
                enable_ac=True,
                ac_stage_size_gib=size,
            )
        )
    for p in out:
        p.recompute_flops = p.backward_flops - replay.backward_flops
        p.recompute_bytes_moved = p.backward_bytes_moved - replay.backward_bytes_moved
    return out


def matched_table(rows: list[Point]) -> str:
    """Per torch point inside our range: torch's best solver there and ours at a budget of
    exactly its saved bytes (so ours saves at most what torch saves)."""
    lines = [
        "| model | saved bytes (torch) | torch best: solver | MFLOPs | MB moved | "
        "ours: saved bytes | MFLOPs | MB moved | ours <= torch (FLOPs) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    ours = {(p.model, p.setting): p for p in rows if p.policy == "ours @ torch's bytes"}
    for (model, setting), mine in ours.items():
        torch_at = [
            p
            for p in rows
            if p.model == model
            and p.policy.startswith("torch ")
            and f"{p.saved_bytes:,} B" == setting
        ]
        best = min(torch_at, key=lambda p: (p.recompute_flops, p.recompute_bytes_moved))
        solvers = "/".join(
            p.policy.removeprefix("torch ")
            for p in torch_at
            if p.recompute_flops == best.recompute_flops
        )
        verdict = "yes" if mine.recompute_flops <= best.recompute_flops else "no"
        lines.append(
            f"| {model} | {best.saved_bytes:,} | {solvers} | {best.recompute_flops / 1e6:.2f} | "
            f"{best.recompute_bytes_moved / 1e6:.3f} | {mine.saved_bytes:,} | "
            f"{mine.recompute_flops / 1e6:.2f} | {mine.recompute_bytes_moved / 1e6:.3f} | "
            f"{verdict} |"
        )
    return "\n".join(lines)


def _has_scipy() -> bool:
    import importlib.util

    return importlib.util.find_spec("scipy") is not None


def table(rows: list[Point]) -> str:
    lines = [
        "| model | policy | setting | saved bytes | recompute MFLOPs | recompute MB moved | "
        "compile s |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for p in rows:
        lines.append(
            f"| {p.model} | {p.policy} | {p.setting} | {p.saved_bytes:,} | "
            f"{p.recompute_flops / 1e6:.2f} | {p.recompute_bytes_moved / 1e6:.3f} | "
            f"{p.compile_s:.1f} |"
        )
    return "\n".join(lines)


def plot(rows: list[Point], directory: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for model in dict.fromkeys(p.model for p in rows):
        fig, ax = plt.subplots(figsize=(6, 4))
        for policy in dict.fromkeys(p.policy for p in rows if p.model == model):
            pts = sorted(
                (p.saved_bytes / 1e3, p.recompute_flops / 1e6)
                for p in rows
                if p.model == model and p.policy == policy
            )
            ax.plot(*zip(*pts, strict=True), marker="o", label=policy)
        ax.set_xlabel("saved activations (KB)")
        ax.set_ylabel("recompute (MFLOPs added to the backward)")
        ax.set_title(f"{model}: activation budget sweep")
        ax.legend()
        path = os.path.join(directory, f"activation_budget_{model}.png")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        files.append(path)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--points", type=int, default=5)
    parser.add_argument("--models", default="")
    parser.add_argument("--plot", default="")
    parser.add_argument("--json", default="")
    parser.add_argument(
        "--no-matched",
        action="store_true",
        help="skip ours at each torch point's saved bytes (the matched comparison)",
    )
    args = parser.parse_args(argv)
    rows: list[Point] = []
    for name, build in _models(args.layers).items():
        if args.models and name not in args.models.split(","):
            continue
        rows += sweep(name, build, args.points, matched=not args.no_matched)
        print(table([r for r in rows if r.model == name]), flush=True)
        if not args.no_matched:
            print(matched_table([r for r in rows if r.model == name]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    if args.plot:
        os.makedirs(args.plot, exist_ok=True)
        print("\n".join(plot(rows, args.plot)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
