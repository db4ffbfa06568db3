"""The expert-parallel route matrix (issue 34): every way a user compiles an MoE with
``autoparallel_backend(ep_chunk=...)``, at ``REAL_EP_WORLD`` = 2 gloo ranks.

A :class:`Case` picks one value on each axis:

* ``model``: torchtitan's Qwen3-MoE (``qwen3``), DeepSeek-V3 (``dsv3``), or the ap model kit's
  MoE transformer (``kit``: ``ap_backend.models.Transformer(ModelConfig(moe=True, ep=...))``);
* ``ep``: ``real`` (experts over the ranks, tokens exchanged ``all_to_all_single``:
  ``zoo.models.expert_parallel`` / ``ModelConfig(ep=True)``) or ``local`` (every expert on each
  rank; torchtitan's models with fp32 experts, like the real-EP ones);
* ``precompile``: ``precompile(step, batch)`` then ``torch.compile(pm, backend=...)``, or
  ``torch.compile(step, backend=...)`` directly with ``capture_scalar_outputs=True`` (how
  torchtitan's ``apply_compile`` users compile MoE);
* ``marks``: the token route: ``hinted`` (``mark_chunk_dim(t, 0, hint=t.shape[0])`` on every
  input of the first call), ``static`` (``hint=None``), ``names`` (no marks;
  ``ChunkConfig(chunk_inputs=...)`` names the joint graph's token placeholders, found as a
  user finds them: the placeholders AOTAutograd describes as the token arguments, read off a
  trace of the same call), ``none`` (no marks, no names: the error case);
* ``loss``: ``inside`` (the compiled callable returns the loss) or ``outside`` (it returns the
  logits; the cross-entropy runs eagerly after it, so the joint graph gets a full-batch
  tangent);
* ``config``: ``default`` (``autoparallel_backend(ep_chunk=...)``) or ``full``
  (``enable_ac=True, bucketing=True, overlap_scheduling=True``, and on the precompile route
  ``precompile(..., joint_pass=ap_tags.ac_joint_pass())``);
* ``num_chunks``: 1 (``ep_chunk=None``: the unchunked backend, the marks still applied), 2, 4.

Each case trains 2 SGD steps (eager first, the reference; EP's chunks are dropless, so
chunking does not change the maths and eager is the reference for every N, as in
``tests/test_ep_routes.py``), then compiled, and reports on its worst rank ``outcome``:

* ``"ok"``: ran, loss / gradients within ``LOSS_RTOL`` / ``GRAD_RTOL`` of eager (``loss_rel``,
  ``grad_rel``; ``all_to_all_fw`` / ``all_to_all_bw``: ``all_to_all_single`` in the graphs
  handed to Inductor; ``chunked_regions``; ``seconds``);
* ``"refused"``: a ``ChunkError`` / ``PrecompileError`` (anywhere in the exception's chain:
  Dynamo wraps a backend's error) -- both are raised only while compiling, before any
  compiled code ran; ``stage`` and ``error`` say where and why;
* ``"failed"``: anything else, including numerics out of tolerance (``stage="numerics"``) --
  the outcome the property test forbids.

``python -m zoo.ep_routes --cases all|sample|default --json F --md F`` runs a matrix in
batches of 2-rank spawns (each batch reuses its process group) and rewrites ``F`` after every
batch (``--resume`` skips the cases already in ``--json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zoo.ep import EP_BATCH, PATTERN, REAL_EP_WORLD, _count_a2a, _moe_layers

__all__ = [
    "AXES",
    "DEFAULT_CASES",
    "GRAD_RTOL",
    "LOSS_RTOL",
    "Case",
    "all_cases",
    "pairwise_cases",
    "render",
    "run_case",
    "run_route_case",
    "run_routes",
]

#: fp32 experts everywhere: the precompile route's tolerances
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4

#: every axis and its values, in the order of :class:`Case`'s fields
AXES: dict[str, tuple[Any, ...]] = {
    "model": ("qwen3", "dsv3", "kit"),
    "precompile": (False, True),
    "marks": ("hinted", "static", "names"),
    "loss": ("inside", "outside"),
    "ep": ("real", "local"),
    "config": ("default", "full"),
    "num_chunks": (1, 2, 4),
}
_TT = {"qwen3": "tt_qwen3_moe", "dsv3": "tt_deepseek_v3"}


@dataclass(frozen=True)
class Case:
    model: str = "qwen3"
    precompile: bool = False
    marks: str = "hinted"
    loss: str = "inside"
    ep: str = "real"
    config: str = "default"
    num_chunks: int = 2

    def __post_init__(self) -> None:
        for name, values in AXES.items():
            value = getattr(self, name)
            if value not in values and not (name == "marks" and value == "none"):
                raise ValueError(f"Case.{name}={value!r}: not one of {values}")

    @property
    def key(self) -> str:
        route = "precompile" if self.precompile else "torch.compile"
        return (
            f"{self.model}/{self.ep}/{route}/{self.marks}/loss-{self.loss}/{self.config}/"
            f"N={self.num_chunks}"
        )


def all_cases() -> list[Case]:
    """The full product of :data:`AXES` (432 cases)."""
    return [Case(*values) for values in itertools.product(*AXES.values())]


def pairwise_cases() -> list[Case]:
    """A deterministic pairwise covering sample: every pair of values of every two axes occurs
    in some case (greedy, AETG-style: repeatedly the case of the full product that covers the
    most uncovered pairs, the first such in product order)."""
    names = list(AXES)
    product = all_cases()

    def pairs(c: Case) -> set[tuple[str, Any, str, Any]]:
        vals = [(n, getattr(c, n)) for n in names]
        return {(a, va, b, vb) for (a, va), (b, vb) in itertools.combinations(vals, 2)}

    uncovered = set().union(*(pairs(c) for c in product))
    chosen: list[Case] = []
    while uncovered:
        best = max(product, key=lambda c: len(pairs(c) & uncovered))
        chosen.append(best)
        uncovered -= pairs(best)
    return chosen


#: the default test's cases beyond ``tests/test_ep_routes.py``'s three Qwen3-MoE ones: together
#: they cover every value of every axis at least once
DEFAULT_CASES = [
    Case("kit", True, "names", "outside", "local", "full", 4),
    Case("dsv3", False, "hinted", "inside", "real", "default", 1),
]


# ----------------------------------------------------------------------------------------------
# one case


@dataclass
class _Built:
    root: torch.nn.Module  # what annotate_module_fqns annotates (the model)
    step: torch.nn.Module  # what is compiled
    params: list[tuple[str, torch.nn.Parameter]]
    batches: list[tuple[torch.Tensor, ...]]  # the compiled callable's inputs, per step
    targets: list[tuple[torch.Tensor, ...]]  # loss outside: the eager loss's extra inputs
    loss_fn: Callable[..., torch.Tensor] | None  # loss outside: (output, *targets) -> loss
    state: Any  # restorable parameters and buffers


def _build(case: Case) -> _Built:
    import torch.distributed as dist
    from torch import nn

    from zoo.fsdp import FsdpTrainStep
    from zoo.models import MODELS
    from zoo.models._base import token_batches
    from zoo.models.expert_parallel import EP_MODELS, cpu_expert_parallel, fp32_experts
    from zoo.run import _rank_batches, _shard_params, _sharded_step, _State

    rank = dist.get_rank()
    if case.model == "kit":
        import torch.nn.functional as F
        from ap_backend.models import ModelConfig, Sharding, Transformer

        cfg = ModelConfig(moe=True, ep=case.ep == "real", batch=EP_BATCH, seed=0)
        model = Transformer(cfg, Sharding.from_world())
        full = [model.example_batch(s, rank) for s in range(2)]
        params = [(n, p) for n, p in model.named_parameters()]

        def kit_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

        inside = case.loss == "inside"
        return _Built(
            model,
            model,
            params,
            [b if inside else b[:1] for b in full],
            [() if inside else b[1:] for b in full],
            None if inside else kit_loss,
            _State(model),
        )
    cpu_expert_parallel()
    if case.ep == "real":
        zm = EP_MODELS[f"{_TT[case.model]}_ep"](2)
    else:
        zm = MODELS[_TT[case.model]](2)
        fp32_experts(zm.module)
    zm.batches = list(token_batches(2, batch=EP_BATCH))
    batches = _rank_batches(zm, rank)
    n = zm.n_model_inputs
    if case.loss == "inside":
        step: nn.Module = _sharded_step(zm)
        built = _Built(zm.module, step, [], batches, [()] * len(batches), None, None)
    else:
        step = FsdpTrainStep(
            zm.module,
            lambda out: out,
            n_model_inputs=n,
            model_kwargs=zm.model_kwargs,
            input_names=zm.input_names,
        )
        built = _Built(
            zm.module,
            step,
            [],
            [b[:n] for b in batches],
            [b[n:] for b in batches],
            zm.loss_fn,
            None,
        )
    assert isinstance(step, FsdpTrainStep)
    built.params = _shard_params(step)
    built.state = _State(step)
    return built


def _train(
    fn: Callable[..., torch.Tensor], built: _Built, stage: list[str]
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """2 SGD steps, ``stage[0]`` naming where it is (the first call compiles the forward, the
    first backward the backward)."""
    from zoo.run import sgd_step

    losses: list[float] = []
    grads: list[dict[str, torch.Tensor]] = []
    for i, (batch, targets) in enumerate(zip(built.batches, built.targets, strict=True)):
        stage[0] = f"step {i + 1} forward"
        out = fn(*batch)
        loss = out if built.loss_fn is None else built.loss_fn(out, *targets)
        stage[0] = f"step {i + 1} backward"
        loss.backward()  # type: ignore[no-untyped-call]
        losses.append(float(loss.detach()))
        grads.append(sgd_step(built.params))
    return losses, grads


def _joint_input_names(fn: Any, batch: Sequence[torch.Tensor]) -> tuple[str, ...]:
    """The names of the joint-graph placeholders of ``batch``'s tensors in ``fn(*batch)``'s
    compilation (what a user names in ``ChunkConfig.chunk_inputs``): an AOTAutograd trace of
    the same call whose partitioner reads the placeholders' input descriptors and stops."""
    from ap_tags.tracing import aot_input_index
    from torch._dynamo.backends.common import aot_autograd

    found: list[str] = []

    class _Found(Exception):
        pass

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        ptrs = {
            (t.data_ptr(), tuple(t.shape))
            for t in batch
            if isinstance(t, torch.Tensor) and t.dim() > 0
        }
        wanted = {
            i
            for i, x in enumerate(example_inputs)
            if isinstance(x, torch.Tensor) and (x.data_ptr(), tuple(x.shape)) in ptrs
        }

        def partition(joint: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
            for p in joint.graph.find_nodes(op="placeholder"):
                if aot_input_index(p) in wanted:
                    found.append(p.name)
            raise _Found

        return aot_autograd(fw_compiler=lambda g, _: g, partition_fn=partition)(gm, example_inputs)

    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            compiled: Callable[..., Any] = torch.compile(fn, backend=backend)
            compiled(*batch)
    except Exception as exc:  # noqa: BLE001 - _Found ends the trace, wrapped by Dynamo
        if not _in_chain(exc, (_Found,)):
            raise
    finally:
        torch._dynamo.reset()
    return tuple(found)


def _in_chain(exc: BaseException | None, types: tuple[type[BaseException], ...]) -> bool:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, types):
            return True
        seen.add(id(exc))
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
    return False


def run_case(case: Case) -> dict[str, Any]:
    """One case on this rank of an initialised gloo group (see the module docstring)."""
    import ap_tags
    from ap_backend import PrecompileError, autoparallel_backend, precompile
    from ap_epchunk import ChunkConfig, ChunkError, mark_chunk_dim
    from ap_tags import annotate_module_fqns

    from zoo.run import _grads_rel, _loss_rel

    row: dict[str, Any] = {"key": case.key, **dataclasses.asdict(case)}
    stage = ["build"]
    compiled = [False]
    torch._dynamo.reset()
    start = time.perf_counter()
    try:
        built = _build(case)
        row["moe_layers"] = _moe_layers(built.root)
        stage[0] = "eager"
        ref_losses, ref_grads = _train(built.step, built, stage)
        built.state.restore()
        chunk: ChunkConfig | None = None
        if case.num_chunks > 1:
            chunk = ChunkConfig((PATTERN,), num_chunks=case.num_chunks)
        first = built.batches[0]
        if case.marks in ("hinted", "static"):
            for t in first:
                mark_chunk_dim(t, 0, hint=None if case.marks == "static" else t.shape[0])
        full = case.config == "full"
        options: dict[str, Any] = (
            {"enable_ac": True, "bucketing": True, "overlap_scheduling": True} if full else {}
        )
        with (
            torch._dynamo.config.patch(capture_scalar_outputs=True),
            annotate_module_fqns(built.root),
        ):
            fn: Any = built.step
            if case.precompile:
                stage[0] = "precompile"
                joint = ap_tags.ac_joint_pass() if full else None
                fn = precompile(built.step, first, joint_pass=joint)
                built.state.restore()
            if case.marks == "names" and chunk is not None:
                stage[0] = "chunk_inputs names"
                names = _joint_input_names(fn, first)
                row["chunk_inputs"] = list(names)
                chunk = chunk.replace(chunk_inputs=names)
            backend = autoparallel_backend(ep_chunk=chunk, **options)
            original = backend._inner_compile

            def inner(*args: Any, **kwargs: Any) -> Any:
                out = original(*args, **kwargs)
                compiled[0] = True
                return out

            backend._inner_compile = inner  # type: ignore[method-assign]
            losses, grads = _train(torch.compile(fn, backend=backend), built, stage)
        loss_rel = _loss_rel(losses, ref_losses)
        grad_rel = _grads_rel(grads, ref_grads)[0]
        regions = backend.chunk_reports[-1].regions if backend.chunk_reports else []
        row.update(
            outcome="ok",
            loss_rel=loss_rel,
            grad_rel=grad_rel,
            all_to_all_fw=_count_a2a(backend, backward=False),
            all_to_all_bw=_count_a2a(backend, backward=True),
            chunked_regions=len(regions),
            region_all_to_alls=[r.all_to_alls for r in regions],
            schedule=[
                [r.backward, r.exchanges_paired, r.exposed_before, r.exposed_after, r.reason]
                for report in backend.schedule_reports
                for r in report.regions
            ],
        )
        if not (loss_rel <= LOSS_RTOL and grad_rel <= GRAD_RTOL):
            row.update(outcome="failed", stage="numerics")
            row["error"] = f"loss rel {loss_rel:.2e} / grad rel {grad_rel:.2e} vs eager"
    except Exception as exc:  # noqa: BLE001 - every outcome is recorded
        refused = _in_chain(exc, (ChunkError, PrecompileError))
        row.update(outcome="refused" if refused else "failed", stage=stage[0])
        row["compiled_before_error"] = compiled[0]
        row["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        if not refused:
            row["traceback"] = "".join(traceback.format_exception(exc)[-6:])[:3000]
    finally:
        torch._dynamo.reset()
    row["seconds"] = time.perf_counter() - start
    return row


def run_route_case(model: str, marks: str, num_chunks: int) -> dict[str, Any]:
    """The no-precompile route of ``tests/test_ep_routes.py`` (``model``: ``tt_qwen3_moe_ep``
    / ``tt_deepseek_v3_ep``; ``marks``: ``hinted`` / ``static`` / ``none``)."""
    short = {v + "_ep": k for k, v in _TT.items()}[model]
    row = run_case(Case(short, False, marks, "inside", "real", "default", num_chunks))
    row["model"] = model
    return row


# ----------------------------------------------------------------------------------------------
# ranks


def _rank(rank: int, world: int, port: int, cases: list[Any], out: str, timeout_s: int) -> None:
    import datetime as dt

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=dt.timedelta(seconds=timeout_s)
    )
    path = Path(f"{out}.{rank}")
    rows: list[dict[str, Any]] = []
    try:
        for case in cases:
            if isinstance(case, Case):
                rows.append(run_case(case))
            else:
                rows.append(run_route_case(*case))
            path.write_text(json.dumps(rows))  # what finished survives a crash
    finally:
        dist.destroy_process_group()


def _merge(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The worst rank's row: failed over refused over ok; between ok rows the larger errors."""
    order = {"failed": 0, "refused": 1, "ok": 2}
    row = dict(min(rows, key=lambda r: order[r["outcome"]]))
    if all(r["outcome"] == "ok" for r in rows):
        row["loss_rel"] = max(r["loss_rel"] for r in rows)
        row["grad_rel"] = max(r["grad_rel"] for r in rows)
    row["ranks"] = [r["outcome"] for r in rows]
    return row


def run_routes(
    cases: Sequence[Case | tuple[str, str, int]],
    *,
    world: int = REAL_EP_WORLD,
    port: int = 29650,
    timeout_s: int = 600,
) -> list[dict[str, Any]]:
    """Spawn ``world`` gloo ranks, run ``cases`` (:class:`Case`, or ``(model, marks,
    num_chunks)`` for :func:`run_route_case`) in that one group, and keep per case the worst
    rank's row. A rank that dies leaves the cases it did not finish as ``failed`` rows
    (``stage="spawn"``)."""
    import torch.multiprocessing as mp

    root = str(Path(__file__).resolve().parent.parent)
    added = root not in sys.path
    if added:
        sys.path.insert(0, root)
    crash = ""
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = f"{tmp}/rows"
            try:
                mp.spawn(_rank, args=(world, port, list(cases), out, timeout_s), nprocs=world)  # type: ignore[attr-defined,no-untyped-call]
            except Exception as exc:  # noqa: BLE001 - recorded on the unfinished cases
                crash = f"{type(exc).__name__}: {exc}"[:2000]
            per_rank = []
            for r in range(world):
                path = Path(f"{out}.{r}")
                per_rank.append(json.loads(path.read_text()) if path.exists() else [])
    finally:
        if added:
            sys.path.remove(root)
    merged = []
    for i, case in enumerate(cases):
        rows = [ranked[i] for ranked in per_rank if i < len(ranked)]
        if len(rows) == world:
            merged.append(_merge(rows))
            continue
        key = case.key if isinstance(case, Case) else "/".join(map(str, case))
        base = dataclasses.asdict(case) if isinstance(case, Case) else {}
        merged.append(
            {"key": key, **base, "outcome": "failed", "stage": "spawn", "error": crash or "?"}
        )
    return merged


# ----------------------------------------------------------------------------------------------
# report


def render(rows: Sequence[dict[str, Any]]) -> str:
    """A markdown table of ``rows`` and the outcome counts."""
    counts = {o: sum(r["outcome"] == o for r in rows) for o in ("ok", "refused", "failed")}
    out = [
        f"{len(rows)} cases: {counts['ok']} ok, {counts['refused']} refused, "
        f"{counts['failed']} failed\n",
        "| model | EP | route | marks | loss | config | N | outcome | loss / grad rel | "
        "a2a fw / bw | s | stage: error |",
        "|---|---|---|---|---|---|---:|---|---|---|---:|---|",
    ]
    for r in rows:
        rel = f"{r['loss_rel']:.1e} / {r['grad_rel']:.1e}" if r.get("loss_rel") is not None else "-"
        a2a = f"{r['all_to_all_fw']} / {r['all_to_all_bw']}" if "all_to_all_fw" in r else "-"
        err = ""
        if r["outcome"] != "ok" or r.get("error"):
            text = " ".join(str(r.get("error", "")).split())
            err = f"{r.get('stage', '')}: {text[:220]}".replace("|", "\\|")
        route = "precompile" if r["precompile"] else "torch.compile"
        out.append(
            f"| {r['model']} | {r['ep']} | {route} | {r['marks']} | {r['loss']} | {r['config']} "
            f"| {r['num_chunks']} | {r['outcome']} | {rel} | {a2a} | {r.get('seconds', 0):.0f} "
            f"| {err} |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zoo.ep_routes", description=__doc__)
    parser.add_argument("--cases", choices=("all", "sample", "default"), default="sample")
    parser.add_argument("--models", default="", help="comma-separated subset of the models")
    parser.add_argument("--keys", default="", help="comma-separated Case.key substrings to keep")
    parser.add_argument("--json", default="", help="rows written here after every batch")
    parser.add_argument("--md", default="", help="the markdown table written here at the end")
    parser.add_argument("--batch", type=int, default=6, help="cases per 2-rank spawn")
    parser.add_argument("--resume", action="store_true", help="skip cases already in --json")
    parser.add_argument("--timeout", type=int, default=600, help="gloo timeout, seconds")
    parser.add_argument("--port", type=int, default=29650, help="the ranks' MASTER_PORT")
    args = parser.parse_args(argv)
    # the ranks (spawned, so they import torch afresh) compile with Inductor's FX-graph and
    # AOTAutograd caches off: a cache hit skips the backend's joint pass, and a row would then
    # report no chunk pass for a graph a previous case chunked
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
    os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
    choices: dict[str, Callable[[], list[Case]]] = {
        "all": all_cases,
        "sample": pairwise_cases,
        "default": lambda: DEFAULT_CASES,
    }
    cases = choices[args.cases]()
    if args.models:
        cases = [c for c in cases if c.model in args.models.split(",")]
    if args.keys:
        cases = [c for c in cases if any(k in c.key for k in args.keys.split(","))]
    rows: list[dict[str, Any]] = []
    if args.resume and args.json and Path(args.json).exists():
        rows = json.loads(Path(args.json).read_text())
        done = {r["key"] for r in rows}
        cases = [c for c in cases if c.key not in done]
    start = time.perf_counter()
    for i in range(0, len(cases), args.batch):
        batch = cases[i : i + args.batch]
        for row in run_routes(batch, port=args.port, timeout_s=args.timeout):
            rows.append(row)
            brief = {k: row.get(k) for k in ("key", "outcome", "stage", "loss_rel", "grad_rel")}
            print(json.dumps(brief), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    table = render(rows)
    load = os.getloadavg()
    table += (
        f"\n`python -m zoo.ep_routes {' '.join(argv if argv is not None else sys.argv[1:])}`, "
        f"{datetime.datetime.now().isoformat(timespec='minutes')}, "
        f"{time.perf_counter() - start:.0f} s, load {load[0]:.1f}\n"
    )
    print(table)
    if args.md:
        Path(args.md).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
