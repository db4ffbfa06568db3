"""Section 9: generated kernels, saved bytes and compile time at the CPU shape (issue 35).

* **Kernels and saved bytes**: the model kit (dim 256, 2 layers, seq 512, batch 2) and the zoo's
  torchtitan Llama3 (2 layers, dim 256, seq 1024, batch 2), bf16 gathers for the kit, fake PG
  world 8; rows plain ``torch.compile``, tagged min-cut (``autoparallel_backend(partitioner=
  "min_cut", bucketing=False)`` on ``precompile``'s output), ap default and ap full (see
  :mod:`benchmarks.gpu` for each row's definition). Kernels:
  ``torch._inductor.metrics.generated_kernel_count`` after one forward + backward; saved bytes:
  the backend's ``SavedSummary`` (ap rows) or ``measure_saved(model, partitioner="min_cut",
  enable_ac=False)`` (plain).
* **Compile time**: the model kit at 4 layers (dim 256, seq 256, batch 2, bf16 gathers), one
  fresh process per compile with an empty ``TORCHINDUCTOR_CACHE_DIR``, FX-graph and AOTAutograd
  caches off, ``TORCHINDUCTOR_COMPILE_THREADS=1``, Python bytecode warm (a private
  ``PYTHONPYCACHEPREFIX`` filled by an untimed small compile per configuration, as an installed
  torch has its ``.pyc`` files), rounds interleaved (plain, ap default, ap full, plain, ...),
  the 1-minute load average around each compile. Phases: ``precompile``,
  the first forward (Dynamo + AOTAutograd + partition + forward Inductor compile + one
  forward), the first backward (the lazy backward compile + one backward); compile time =
  precompile + first forward + first backward - one median steady step. Compile CPU time:
  the worker's CPU seconds and those of the compiler processes it waited for
  (``resource.getrusage(RUSAGE_CHILDREN)``), from before ``precompile`` to after the first
  backward -- on a shared 2-core machine far steadier than wall time, which other jobs stretch.

    uv run python -m benchmarks.kernels [--quick] [--rounds N]
"""

from __future__ import annotations

import os

if __name__ == "__main__":
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
    os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"

import json
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ap_backend.models import ModelConfig

from benchmarks import fresh_compile_env, markdown_table, run_worker

KERNEL_ROWS = ("plain", "tagged_min_cut", "ap_default", "ap_full")
COMPILE_CONFIGS = ("plain", "ap_default", "ap_full")
KIT = ModelConfig(dim=256, n_layers=2, n_heads=4, ffn_dim=1024, vocab=1024, seq_len=512, batch=2)
LLAMA3 = {"n_layers": 2, "dim": 256, "seq": 1024}
COMPILE_KIT = ModelConfig(
    dim=256, n_layers=4, n_heads=4, ffn_dim=1024, vocab=1024, seq_len=256, batch=2
)
QUICK_KIT = ModelConfig(dim=64, n_layers=1, n_heads=4, ffn_dim=128, vocab=128, seq_len=64)
QUICK_LLAMA3 = {"n_layers": 1, "dim": 64, "seq": 64}


def _kit(cfg: ModelConfig) -> tuple[Any, tuple[Any, ...]]:
    import torch
    from ap_backend.models import Sharding, Transformer

    model = Transformer(cfg, Sharding.from_world(gather_dtype=torch.bfloat16))
    return model, model.example_batch(0, 0)


def count(model: Any, batch: tuple[Any, ...], key: str) -> dict[str, Any]:
    """Generated kernels and saved bytes of row ``key`` (one forward + backward)."""
    import torch
    import torch._inductor.metrics as inductor_metrics
    from ap_backend import measure_saved

    from benchmarks.gpu import _compiled

    torch.compiler.reset()
    inductor_metrics.reset()
    compiled, backend = _compiled(key, model, batch, None)
    compiled(*batch).backward()  # type: ignore[no-untyped-call]
    model.zero_grad(set_to_none=True)
    kernels = int(inductor_metrics.generated_kernel_count)
    if backend is None:
        torch.compiler.reset()
        saved = measure_saved(model, batch, partitioner="min_cut", enable_ac=False)
    else:
        saved = backend.saved[-1]
    return {
        "kernels": kernels,
        "saved_bytes": saved.nbytes,
        "saved_ag": len(saved.all_gather_outputs),
    }


def kernels(quick: bool) -> list[dict[str, Any]]:
    from ap_testing.distributed import fake_world

    from benchmarks.real_models import build_step

    kit = QUICK_KIT if quick else KIT
    llama = QUICK_LLAMA3 if quick else LLAMA3
    out = []
    with fake_world(8):
        model, batch = _kit(kit)
        label = f"model kit (dim {kit.dim}, {kit.n_layers} layers, seq {kit.seq_len}, batch 2)"
        out.append({"model": label, "rows": {k: count(model, batch, k) for k in KERNEL_ROWS}})
        step, batch = build_step("tt_llama3", llama)
        label = (
            f"torchtitan Llama3 (dim {llama['dim']}, {llama['n_layers']} layers, seq "
            f"{llama['seq']}, batch 2)"
        )
        out.append({"model": label, "rows": {k: count(step, batch, k) for k in KERNEL_ROWS}})
    return out


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its waited-for children (Inductor's C++ compiler)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _worker(config: str, cfg: ModelConfig, steps: int) -> dict[str, Any]:
    """One compile in this (fresh) process, phase by phase."""
    import torch._inductor.metrics as inductor_metrics
    from ap_testing.distributed import fake_world

    from benchmarks.gpu import _compiled

    with fake_world(8):
        model, batch = _kit(cfg)
        cpu_start = _cpu_seconds()
        start = time.perf_counter()
        compiled, _ = _compiled(config, model, batch, None)
        precompile_s = time.perf_counter() - start
        start = time.perf_counter()
        loss = compiled(*batch)
        forward_s = time.perf_counter() - start
        start = time.perf_counter()
        loss.backward()  # type: ignore[no-untyped-call]
        backward_s = time.perf_counter() - start
        compile_cpu_s = _cpu_seconds() - cpu_start
        model.zero_grad(set_to_none=True)
        kernels = int(inductor_metrics.generated_kernel_count)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            compiled(*batch).backward()  # type: ignore[no-untyped-call]
            model.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    return {
        "config": config,
        "precompile_s": precompile_s,
        "first_forward_s": forward_s,
        "first_backward_s": backward_s,
        "step_s": step_s,
        "compile_s": precompile_s + forward_s + backward_s - step_s,
        "compile_cpu_s": compile_cpu_s,
        "kernels": kernels,
    }


def _spawn(config: str, cfg: ModelConfig, steps: int, pycache: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ap-bench-inductor-") as cache:
        env = fresh_compile_env(cache, pycache)
        out = run_worker("benchmarks.kernels", [config, json.dumps(asdict(cfg)), str(steps)], env)
        print(f"  compile {config}: {out}", file=sys.stderr, flush=True)
        return out


def compile_times(quick: bool, rounds: int) -> dict[str, Any]:
    cfg = QUICK_KIT if quick else COMPILE_KIT
    steps = 2 if quick else 3
    with tempfile.TemporaryDirectory(prefix="ap-bench-pycache-") as pycache:
        # untimed: one small compile per configuration writes the bytecode every compile
        # imports (see fresh_compile_env)
        for c in COMPILE_CONFIGS:
            _spawn(c, QUICK_KIT, 1, pycache)
        got = [{c: _spawn(c, cfg, steps, pycache) for c in COMPILE_CONFIGS} for _ in range(rounds)]
    summary = {}
    for c in COMPILE_CONFIGS:
        runs = [r[c] for r in got]
        summary[c] = {
            key: statistics.median(r[key] for r in runs)
            for key in (
                "compile_s",
                "compile_cpu_s",
                "precompile_s",
                "first_forward_s",
                "first_backward_s",
            )
        }
        summary[c]["kernels"] = runs[0]["kernels"]
        for key, ratio in (("compile_s", "ratio"), ("compile_cpu_s", "cpu_ratio")):
            summary[c][ratio] = statistics.median(r[c][key] / r["plain"][key] for r in got)
    return {"shape": asdict(cfg), "rounds": got, "summary": summary}


def run(quick: bool, rounds: int = 2, compile_time: bool = True) -> dict[str, Any]:
    start = time.perf_counter()
    out: dict[str, Any] = {"load_avg_at_start": [round(x, 2) for x in os.getloadavg()]}
    out["kernels"] = kernels(quick)
    if quick:  # a fresh-cache compile per configuration and round takes minutes
        out["compile"] = {"skipped": "full run only"}
    elif not compile_time:
        out["compile"] = {"skipped": "--only kernels"}
    else:
        out["compile"] = compile_times(quick, rounds)
    out["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out["wall_s"] = round(time.perf_counter() - start, 1)
    return out


_LABELS = {
    "plain": "plain `torch.compile`",
    "tagged_min_cut": "tagged min-cut (unbucketed)",
    "ap_default": "ap default",
    "ap_full": "ap full",
}


def markdown(result: dict[str, Any]) -> str:
    parts = [
        f"Load average {result['load_avg_at_start']} at start, {result['load_avg_at_end']} at "
        f"end; fake PG world 8."
    ]
    rows = []
    for m in result["kernels"]:
        plain = m["rows"]["plain"]
        for key, r in m["rows"].items():
            rows.append(
                [
                    m["model"],
                    _LABELS[key],
                    r["kernels"],
                    f"{r['kernels'] / plain['kernels']:.2f}",
                    f"{r['saved_bytes']:,}",
                    f"{r['saved_bytes'] / plain['saved_bytes']:.2f}",
                    r["saved_ag"],
                ]
            )
    parts.append(
        markdown_table(
            (
                ("model", "l"),
                ("row", "l"),
                ("generated kernels", "r"),
                ("/ plain", "r"),
                ("saved bytes", "r"),
                ("/ plain", "r"),
                ("all-gather outputs saved", "r"),
            ),
            rows,
        )
    )
    comp = result["compile"]
    if "skipped" in comp:
        parts.append(f"Compile time: skipped ({comp['skipped']}).")
        return "\n\n".join(parts)
    s = comp["shape"]
    parts.append(
        f"Compile time, model kit dim {s['dim']}, {s['n_layers']} layers, seq {s['seq_len']}, "
        f"batch {s['batch']}, bf16 gathers; {len(comp['rounds'])} interleaved rounds, one fresh "
        "process and Inductor cache dir per compile, Python bytecode warm (medians; ratio = "
        "median of per-round ratios):"
    )
    rows = []
    for c, v in comp["summary"].items():
        per_round = ", ".join(
            f"{r[c]['compile_s']:.1f} / {r[c]['compile_cpu_s']:.1f} "
            f"({r[c]['load_before']}→{r[c]['load_after']})"
            for r in comp["rounds"]
        )
        rows.append(
            [
                _LABELS[c],
                f"{v['compile_s']:.1f}",
                f"{v['ratio']:.2f}",
                f"{v['compile_cpu_s']:.1f}",
                f"{v['cpu_ratio']:.2f}",
                f"{v['precompile_s']:.1f}",
                f"{v['first_forward_s']:.1f}",
                f"{v['first_backward_s']:.1f}",
                v["kernels"],
                per_round,
            ]
        )
    parts.append(
        markdown_table(
            (
                ("config", "l"),
                ("compile s", "r"),
                ("/ plain", "r"),
                ("compile CPU s", "r"),
                ("/ plain", "r"),
                ("precompile s", "r"),
                ("first forward s", "r"),
                ("first backward s", "r"),
                ("generated kernels", "r"),
                ("per round wall / CPU s (load before→after)", "l"),
            ),
            rows,
        )
    )
    return "\n\n".join(parts)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        config, shape, n_steps = sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
        print(json.dumps(_worker(config, ModelConfig(**shape), n_steps)))
    else:
        import argparse

        parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels")
        parser.add_argument("--quick", action="store_true")
        parser.add_argument("--rounds", type=int, default=2)
        parser.add_argument("--json", type=Path)
        parser.add_argument("--only", choices=("kernels", "compile"))
        ns = parser.parse_args()
        if ns.only == "compile":
            result = {
                "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
                "kernels": [],
                "compile": compile_times(ns.quick, ns.rounds),
                "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
            }
        else:
            result = run(ns.quick, ns.rounds, compile_time=ns.only != "kernels")
        if ns.json is not None:
            ns.json.write_text(json.dumps(result, indent=1))
        print(markdown(result))
