"""EP overlap (#24): step time and exposed token-exchange time on the real EP zoo models.

    nice -n 10 uv run python -m benchmarks.ep_overlap [--rounds R] [--steps S] [--models ...]

torchtitan's Qwen3-MoE and DeepSeek-V3 debug models with their experts sharded over 2 gloo ranks
(``zoo.models.expert_parallel``), compiled through ``precompile`` + ``autoparallel_backend`` on
the zoo's EP batch, in these variants (one precompile per model, every variant compiled in the
same process, so they interleave):

* ``unchunked``: ``ep_chunk=None``;
* ``N=2`` / ``N=4``: chunked, ``ChunkConfig(schedule_overlap=False)`` (the chunk pass's
  node-by-node interleaving);
* ``N=2 ours`` / ``N=4 ours``: chunked + ``schedule_chunk_overlap`` (the default);
* ``N=2 ours, 500 us``: ours with the cost model's collective latency at 500 us instead of
  50 us (an A/B of that one constant, ``ap_epchunk._schedule_cost.LATENCY_S``);
* ``N=2 ours, no FSDP placement``: ours with ``ChunkConfig(place_fsdp_collectives=False)``
  (the backward's FSDP re-gathers left where the pipeline puts them, inside the span);
* ``N=2 ours, old drain``: ours without the drain rule (``ap_epchunk._schedule_order.
  DRAIN_FILLER_FIRST = False``: waits before filler in the drain when estimated done);
* ``N=2 ours, neither``: both of the above off (the scheduler as issue 24 first measured it);
* ``N=2 torchtitan``: chunked, then torchtitan 0.3.0's ``ep_overlap_schedule_pass`` (two chunks
  only) on the same joint graph instead of ours, its metadata (``chunked_region_role``,
  ``chunk_id``, ``EP_token_exchange`` labels on the token exchanges) translated from ours.

The partitioned graphs run as FX graphs (no Inductor codegen): what runs is the order the
schedule produced (Inductor's own scheduler may reorder; see ``ap_epchunk._schedule``). Every
``wait_tensor`` on an ``all_to_all_single`` is replaced by a timing wrapper around the same op:
*exposed all-to-all time* is the time a rank spends inside those waits. gloo runs collectives on
its own threads, so a wait that finds its exchange finished costs ~nothing. *Other waits* is the
same for every other collective's wait (the FSDP all-gathers and reduce-scatters): what placing
them outside the exchanges' spans trades against.

Measurement: ``rounds`` rounds, each running every variant for ``steps`` forward+backward steps
(a ``dist.barrier()`` before each step; no optimizer step), variants interleaved; per variant
the median over all its steps of each rank, then the mean of the two ranks. The 1-minute load
average is recorded at each round.
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

import torch

MODELS = ("tt_qwen3_moe_ep", "tt_deepseek_v3_ep")
PATTERN = "layers.*.moe"
#: (variant, num_chunks, scheduler: None | "ours" | "torchtitan")
VARIANTS: tuple[tuple[str, int, str | None], ...] = (
    ("unchunked", 1, None),
    ("N=2", 2, None),
    ("N=2 ours", 2, "ours"),
    ("N=2 torchtitan", 2, "torchtitan"),
    ("N=2 ours, 500 us", 2, "ours-500us"),
    ("N=2 ours, no FSDP placement", 2, "ours-no-placement"),
    ("N=2 ours, old drain", 2, "ours-old-drain"),
    ("N=2 ours, neither", 2, "ours-neither"),
    ("N=4", 4, None),
    ("N=4 ours", 4, "ours"),
)

_EXPOSED = [0.0]
#: seconds inside the waits of every other collective (FSDP all-gathers, reduce-scatters)
_EXPOSED_OTHER = [0.0]
#: per exchange (see :func:`_exchange_key`): seconds inside its wait, summed over timed steps
_BY_EXCHANGE: dict[str, float] = {}
_TIMING = [False]


def _timed_wait(key: str) -> Any:
    """``wait_tensor`` of one token exchange, timed (the exposed all-to-all time)."""

    def wait(x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out: torch.Tensor = torch.ops._c10d_functional.wait_tensor.default(x)
        spent = time.perf_counter() - start
        _EXPOSED[0] += spent
        if _TIMING[0]:
            _BY_EXCHANGE[key] = _BY_EXCHANGE.get(key, 0.0) + spent
        return out

    wait.__name__ = f"timed_wait_{len(_BY_EXCHANGE)}"
    return wait


def _timed_other_wait(x: torch.Tensor) -> torch.Tensor:
    """``wait_tensor`` of any other collective, timed (FSDP's exposed time: what placing the
    FSDP collectives outside the exchanges' spans trades against)."""
    start = time.perf_counter()
    out: torch.Tensor = torch.ops._c10d_functional.wait_tensor.default(x)
    _EXPOSED_OTHER[0] += time.perf_counter() - start
    return out


def _is_a2a(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and "all_to_all_single" in str(node.target)


def _exchange_key(launch: torch.fx.Node, backward: bool, k: int) -> str:
    """``fw layers.0.moe c1 x2``: direction, region, chunk and the exchange's position in it."""
    custom = launch.meta.get("custom") or {}
    region = custom.get("ap_chunk_region") or str(custom.get("module_fqn", "?")).rsplit(".", 1)[0]
    chunk = custom.get("ap_chunk_index")
    return f"{'bw' if backward else 'fw'} {region} c{chunk if chunk is not None else '-'} x{k}"


def _fx_inner(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
    """Run the partitioned graph as FX, its token-exchange waits timed."""
    backward = bool(kwargs.get("is_backward", False))
    seen: dict[tuple[Any, Any], int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and "wait_tensor" in str(node.target):
            launch = next((a for a in node.all_input_nodes if _is_a2a(a)), None)
            if launch is None:
                node.target = _timed_other_wait
                continue
            custom = launch.meta.get("custom") or {}
            slot = (custom.get("ap_chunk_region"), custom.get("ap_chunk_index"))
            k = seen[slot] = seen.get(slot, -1) + 1
            node.target = _timed_wait(_exchange_key(launch, backward, k))
    gm.recompile()

    def run(args: list[Any]) -> Any:
        outs = gm(*args)
        args.clear()
        return outs

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def torchtitan_schedule(gm: torch.fx.GraphModule, **_: Any) -> Any:
    """torchtitan's ``ep_overlap_schedule_pass`` on our chunked joint graph (N=2): our chunk
    metadata translated to the keys its ``collect_chunked_regions`` reads, the float exchanges
    of each chunk labelled ``dispatch`` / ``combine`` in order (the int64 count exchange is not
    one of its markers)."""
    from ap_epchunk._schedule_regions import chunked_regions
    from torchtitan.experiments.graph_trainer.common_utils import _EP_TOKEN_EXCHANGE
    from torchtitan.experiments.graph_trainer.ep_overlap_pass import ep_overlap_schedule_pass

    for region in chunked_regions(gm.graph):
        for chunk, nodes in region.chunks.items():
            floats = 0
            for node in nodes:
                node.meta["chunked_region_role"] = "body"
                node.meta["chunk_id"] = chunk
                node.meta["chunked_region_fqn"] = region.root
                node.meta["chunked_region_is_backward"] = region.backward
                val = node.meta.get("val")
                if _is_a2a(node) and getattr(val, "dtype", None) != torch.int64:
                    custom = dict(node.meta.get("custom") or {})
                    custom[_EP_TOKEN_EXCHANGE] = "dispatch" if floats == 0 else "combine"
                    node.meta["custom"] = custom
                    floats += 1
    ep_overlap_schedule_pass(gm, module_pattern=PATTERN, pair_first_token_exchange=True)
    from ap_epchunk import ScheduleReport

    return ScheduleReport()


def _rank(
    rank: int, world: int, models: list[str], rounds: int, steps: int, variants: list[str]
) -> dict[str, Any]:
    import ap_epchunk
    import torch._inductor.compile_fx as cfx
    import torch.distributed as dist
    from ap_backend import autoparallel_backend
    from ap_epchunk import ChunkConfig

    from zoo.ep import precompiled_ep_step
    from zoo.models.expert_parallel import cpu_expert_parallel

    cpu_expert_parallel()
    cfx.compile_fx_inner = _fx_inner  # type: ignore[assignment]
    import ap_epchunk._schedule_cost as cost
    import ap_epchunk._schedule_order as order

    ours = ap_epchunk.schedule_chunk_overlap
    latency = cost.LATENCY_S
    out: dict[str, Any] = {"rank": rank, "models": {}, "load": []}
    torch._dynamo.config.cache_size_limit = 16
    for model in models:
        pm, batch, params, _ = precompiled_ep_step(model, rank)
        compiled: dict[str, Any] = {}
        errors: dict[str, str] = {}
        for name, n, scheduler in VARIANTS:
            if variants and name not in variants:
                continue
            config = (
                ChunkConfig(
                    (PATTERN,),
                    num_chunks=n,
                    schedule_overlap=scheduler is not None,
                    place_fsdp_collectives=scheduler not in ("ours-no-placement", "ours-neither"),
                )
                if n > 1
                else None
            )
            ap_epchunk.schedule_chunk_overlap = (  # type: ignore[attr-defined]
                torchtitan_schedule if scheduler == "torchtitan" else ours
            )
            cost.LATENCY_S = 500e-6 if scheduler == "ours-500us" else latency
            order.DRAIN_FILLER_FIRST = scheduler not in ("ours-old-drain", "ours-neither")
            fn = torch.compile(pm, backend=autoparallel_backend(ep_chunk=config))
            try:
                fn(*batch).backward()  # compiles forward and backward
                compiled[name] = fn
            except Exception as exc:  # noqa: BLE001 - a refused variant is a result
                errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            finally:
                ap_epchunk.schedule_chunk_overlap = ours  # type: ignore[attr-defined]
                cost.LATENCY_S = latency
                order.DRAIN_FILLER_FIRST = True
            for _, p in params:
                p.grad = None
        times: dict[str, list[float]] = {name: [] for name in compiled}
        exposed: dict[str, list[float]] = {name: [] for name in compiled}
        other: dict[str, list[float]] = {name: [] for name in compiled}
        per_exchange: dict[str, dict[str, float]] = {name: {} for name in compiled}
        for _ in range(rounds):
            out["load"].append(os.getloadavg()[0])
            for name, fn in compiled.items():
                _BY_EXCHANGE.clear()
                _TIMING[0] = True
                for _ in range(steps):
                    dist.barrier()
                    _EXPOSED[0] = _EXPOSED_OTHER[0] = 0.0
                    start = time.perf_counter()
                    fn(*batch).backward()
                    times[name].append(time.perf_counter() - start)
                    exposed[name].append(_EXPOSED[0])
                    other[name].append(_EXPOSED_OTHER[0])
                    for _, p in params:
                        p.grad = None
                _TIMING[0] = False
                for key, spent in _BY_EXCHANGE.items():
                    per_exchange[name][key] = per_exchange[name].get(key, 0.0) + spent
        total_steps = rounds * steps
        out["models"][model] = {
            "per_exchange_ms": {
                name: {k: 1e3 * v / total_steps for k, v in sorted(d.items())}
                for name, d in per_exchange.items()
            },
            "step_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
            "exposed_ms": {k: 1e3 * statistics.median(v) for k, v in exposed.items()},
            "other_wait_ms": {k: 1e3 * statistics.median(v) for k, v in other.items()},
            "errors": errors,
        }
        torch._dynamo.reset()
    return out


def exposed_in_code(code: str) -> tuple[int, int]:
    """``(all_to_all_single launches, those with no kernel call before their wait)`` in an
    Inductor output module: what Inductor kept of the schedule. A launch is an assignment
    ``bufN = torch.ops._c10d_functional.all_to_all_single...(``, its wait the first later
    ``wait_tensor`` call naming ``bufN``; a kernel is a ``cpp_fused_*`` / ``extern_kernels.*`` /
    ``aten`` call (comments skipped)."""
    lines = [ln.strip() for ln in code.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    launch = re.compile(r"^(\w+) = torch\.ops\._c10d_functional\.all_to_all_single\.")
    kernel = re.compile(r"(cpp_fused_\w+\(|extern_kernels\.\w+\(|torch\.ops\.aten\.\w+)")
    launches = exposed = 0
    for i, line in enumerate(lines):
        match = launch.match(line)
        if match is None:
            continue
        launches += 1
        buf = re.compile(rf"\b{match.group(1)}\b")
        for later in lines[i + 1 :]:
            if "wait_tensor" in later and buf.search(later):
                exposed += 1
                break
            if kernel.search(later):
                break
    return launches, exposed


def _inductor_rank(
    rank: int, world: int, model: str, n: int, settings: dict[str, bool]
) -> dict[str, Any]:
    """``model`` chunked in ``n`` through real Inductor (``settings``: Inductor config values
    to set first), schedule off and on: the exposed exchanges of each generated forward /
    backward module."""
    import torch._inductor.compile_fx as cfx
    import torch._inductor.config as inductor_config

    for key, value in settings.items():
        setattr(inductor_config, key, value)
    from ap_backend import autoparallel_backend
    from ap_epchunk import ChunkConfig

    from zoo.ep import precompiled_ep_step
    from zoo.models.expert_parallel import cpu_expert_parallel

    cpu_expert_parallel()
    real_inner = cfx.compile_fx_inner
    codes: list[tuple[bool, str]] = []

    def inner(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        compiled = real_inner(gm, example_inputs, **kwargs)
        path = getattr(compiled, "source_code", None) or ""
        codes.append((bool(kwargs.get("is_backward", False)), str(path)))
        return compiled

    cfx.compile_fx_inner = inner  # type: ignore[assignment]
    pm, batch, _, _ = precompiled_ep_step(model, rank)
    out: dict[str, Any] = {}
    for scheduled in (False, True):
        torch._dynamo.reset()
        codes.clear()
        config = ChunkConfig((PATTERN,), num_chunks=n, schedule_overlap=scheduled)
        torch.compile(pm, backend=autoparallel_backend(ep_chunk=config))(*batch).backward()
        label = "ours" if scheduled else "unscheduled"
        out[label] = {("bw" if bw else "fw"): exposed_in_code(code) for bw, code in codes}
        for bw, code in codes:
            Path(
                f"{tempfile.gettempdir()}/ep_overlap_{label}_{'bw' if bw else 'fw'}_{rank}.py"
            ).write_text(code)
    return out


def run(
    models: list[str], rounds: int, steps: int, variants: list[str] | None = None
) -> dict[str, Any]:
    from ap_backend.demo import spawn_ranks

    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    start = time.perf_counter()
    per_rank = spawn_ranks(_rank, 2, models, rounds, steps, variants or [], timeout_s=3000.0)
    result: dict[str, Any] = {
        "rounds": rounds,
        "steps": steps,
        "wall_s": time.perf_counter() - start,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load": [round(x, 2) for r in per_rank for x in r["load"]],
        "models": {},
    }
    for model in models:
        ranks = [r["models"][model] for r in per_rank]
        variants = ranks[0]["step_ms"].keys()
        result["models"][model] = {
            "step_ms": {v: statistics.mean(r["step_ms"][v] for r in ranks) for v in variants},
            "exposed_ms": {v: statistics.mean(r["exposed_ms"][v] for r in ranks) for v in variants},
            "other_wait_ms": {
                v: statistics.mean(r["other_wait_ms"][v] for r in ranks) for v in variants
            },
            "errors": ranks[0]["errors"],
            "per_exchange_ms": [r["per_exchange_ms"] for r in ranks],
        }
    return result


def markdown(result: dict[str, Any]) -> str:
    load = result["load"]
    lines = [
        f"EP overlap, 2 gloo ranks on {result['cores']} cores, torch {result['torch']}, "
        f"{result['date']}; {result['rounds']} interleaved rounds x {result['steps']} steps per "
        f"variant; 1-min load average {min(load):.2f}-{max(load):.2f} during the rounds. "
        "Medians per rank, mean of the 2 ranks; partitioned graphs run as FX.",
        "",
        "| model | variant | step ms | exposed a2a ms | exposed / N=same unscheduled | "
        "hidden vs unscheduled | other waits ms |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for model, m in result["models"].items():
        for name, _, _ in VARIANTS:
            if name not in m["step_ms"]:
                if name in m["errors"]:  # a variant not asked for has neither
                    lines.append(f"| {model} | {name} | - | - | - | {m['errors'][name]} | - |")
                continue
            base = name.split(" ")[0].rstrip(",")
            ref = m["exposed_ms"].get(base)
            ratio = m["exposed_ms"][name] / ref if ref and base != name else None
            lines.append(
                f"| {model} | {name} | {m['step_ms'][name]:.1f} | {m['exposed_ms'][name]:.2f} | "
                f"{'-' if ratio is None else f'{ratio:.2f}'} | "
                f"{'-' if ratio is None else f'{100 * (1 - ratio):.0f} %'} | "
                f"{m.get('other_wait_ms', {}).get(name, float('nan')):.2f} |"
            )
    lines += [
        "",
        "Exposed ms per step by exchange (mean over steps; rank 0 / rank 1), N=2 variants:",
        "",
    ]
    for model, m in result["models"].items():
        per = m.get("per_exchange_ms") or []
        for name in [v for v, n, _ in VARIANTS if n == 2]:
            if len(per) < 2 or name not in per[0]:
                continue
            cells = [
                f"{k} {per[0][name][k]:.2f}/{per[1][name].get(k, 0.0):.2f}" for k in per[0][name]
            ]
            lines.append(f"- {model} {name}: " + "; ".join(cells))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ep_overlap", description=__doc__)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--variants",
        default="",
        help="semicolon-separated variant names to run (default: all; names hold commas); "
        "e.g. 'N=2;N=2 ours;N=2 torchtitan'",
    )
    parser.add_argument(
        "--inductor-config",
        action="append",
        default=[],
        metavar="KEY=0|1",
        help="with --inductor-order: set this boolean torch._inductor.config value first",
    )
    parser.add_argument(
        "--inductor-order",
        action="store_true",
        help="instead: compile the first model at N=2 through Inductor, schedule off and on, "
        "and count the exchanges left with no kernel before their wait in the generated code",
    )
    args = parser.parse_args(argv)
    if args.inductor_order:
        from ap_backend.demo import spawn_ranks

        root = str(Path(__file__).resolve().parent.parent)
        if root not in sys.path:
            sys.path.insert(0, root)
        settings = {k: v == "1" for k, v in (kv.split("=", 1) for kv in args.inductor_config)}
        model = args.models.split(",")[0]
        ranks = spawn_ranks(_inductor_rank, 2, model, 2, settings, timeout_s=3000.0)
        print(json.dumps(ranks[0]))
        return 0
    variants = [v.strip() for v in args.variants.split(";") if v.strip()]
    unknown = sorted(set(variants) - {v for v, _, _ in VARIANTS})
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {[v for v, _, _ in VARIANTS]}")
    result = run(args.models.split(","), args.rounds, args.steps, variants)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
