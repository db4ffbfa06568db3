"""Section 7: compile time and step time on the zoo's torchtitan Llama3 vs stock Inductor.

Every compile runs in its own subprocess with a fresh, empty ``TORCHINDUCTOR_CACHE_DIR`` and
the FX-graph and AOTAutograd caches off, so no configuration inherits compiled kernels or
graphs from another (in one process Inductor's in-memory code caches would serve the second
compile). ``TORCHINDUCTOR_COMPILE_THREADS=1``: no compile-worker pool. Python bytecode is warm
(``benchmarks.fresh_compile_env``: an untimed small compile per configuration first). Repeats are
interleaved (stock, backend, full, stock, ...) so machine-load drift hits every configuration
alike; the ratio is taken per repeat (each configuration against the stock compile of the same
round) and the median ratio is reported, with the 1-minute load average around each compile.

Compile time = precompile (ap configurations) + the first training step (forward compile, the
lazy backward compile, one step) minus the median steady step. Step time: median of the steady
steps. The model is the zoo's ``FsdpTrainStep`` on the fake process group (world size 8):
collectives do not communicate and the data is garbage, so step times measure the compiled
compute only. Kernels: the C++ kernels Inductor emitted (``cpp_fused_*`` definitions in the
generated wrappers, forward + backward).

    uv run python -m benchmarks.real_models_compile [--quick]
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import fresh_compile_env, markdown_table, run_worker

#: configuration -> autoparallel_backend options (None: stock Inductor, no first compilation)
CONFIGS: dict[str, dict[str, bool] | None] = {
    "stock": None,
    "backend": {},
    "full": {"enable_ac": True, "bucketing": True, "overlap_scheduling": True},
}
#: configurations of the bucketing-form experiment: ``full`` with torch's bucket mode forced
#: (``BucketingConfig(bucket_mode=...)``; ``full`` itself uses ap-bucketing's default,
#: ``"default"``); run with ``--configs``.
BUCKET_MODES = {"full/default": "default", "full/custom_ops": "custom_ops"}
MODEL = "tt_llama3"
FULL = {"layers": 8, "dim": 512, "seq": 128, "repeats": 3, "steps": 6}
QUICK = {"layers": 1, "dim": 64, "seq": 16, "repeats": 1, "steps": 3}
_KERNEL = re.compile(r"^(cpp_fused_\w+) = async_compile\.cpp", re.MULTILINE)


def _worker(config: str, layers: int, dim: int, seq: int, steps: int) -> dict[str, Any]:
    """One compile in this (fresh) process; returns its timings."""
    import torch
    from ap_backend import autoparallel_backend, precompile
    from ap_testing.distributed import fake_world

    from benchmarks.real_models import build_step

    opts: dict[str, Any] | None = CONFIGS.get(config)
    if config in BUCKET_MODES:
        from ap_bucketing import BucketingConfig

        opts = dict(CONFIGS["full"] or {})
        opts["bucketing"] = BucketingConfig(bucket_mode=BUCKET_MODES[config])
    with fake_world():
        step, batch = build_step(MODEL, {"n_layers": layers, "dim": dim, "seq": seq})
        pre_s = 0.0
        if opts is None:
            compiled = torch.compile(step)
        else:
            start = time.perf_counter()
            pm = precompile(step, batch)
            pre_s = time.perf_counter() - start
            compiled = torch.compile(pm, backend=autoparallel_backend(**opts))
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            loss = compiled(*batch)
            loss.backward()
            step.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
    steady = statistics.median(times[1:])
    return {
        "config": config,
        "precompile_s": pre_s,
        "first_step_s": times[0],
        "step_s": steady,
        "compile_s": pre_s + times[0] - steady,
    }


def _kernels(cache_dir: Path) -> int:
    names: set[str] = set()
    for path in cache_dir.rglob("*.py"):
        with open(path, errors="replace") as handle:
            text = handle.read()
        if "async_compile" in text and "def call(" in text:
            names.update(f"{path.name}:{k}" for k in _KERNEL.findall(text))
    return len(names)


def _spawn(config: str, size: dict[str, int], pycache: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ap-bench-inductor-") as cache:
        env = fresh_compile_env(cache, pycache)
        args = [str(size[k]) for k in ("layers", "dim", "seq", "steps")]
        out = run_worker("benchmarks.real_models_compile", [config, *args], env)
        out["kernels"] = _kernels(Path(cache))
        return out


def run(quick: bool, configs: tuple[str, ...] = tuple(CONFIGS), **overrides: int) -> dict[str, Any]:
    if quick and not overrides:
        return {
            "skipped": "full run only: a fresh-cache Inductor compile per configuration "
            "takes minutes on 2 shared cores"
        }
    size = {**(QUICK if quick else FULL), **overrides}
    rounds: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="ap-bench-pycache-") as pycache:
        # untimed: one small compile per configuration writes the bytecode every compile
        # imports (see fresh_compile_env)
        for config in configs:
            _spawn(config, QUICK, pycache)
        for _ in range(size["repeats"]):
            rounds.append({config: _spawn(config, size, pycache) for config in configs})
    summary: dict[str, dict[str, float]] = {}
    for config in configs:
        got = [r[config] for r in rounds]
        summary[config] = {
            "compile_s": statistics.median(g["compile_s"] for g in got),
            "precompile_s": statistics.median(g["precompile_s"] for g in got),
            "step_s": statistics.median(g["step_s"] for g in got),
            "kernels": statistics.median(g["kernels"] for g in got),
            "compile_ratio": statistics.median(
                r[config]["compile_s"] / r["stock"]["compile_s"] for r in rounds
            ),
            "step_ratio": statistics.median(
                r[config]["step_s"] / r["stock"]["step_s"] for r in rounds
            ),
        }
    return {"model": MODEL, **size, "rounds": rounds, "summary": summary}


_COLUMNS = (
    ("configuration", "l"),
    ("compile s (median)", "r"),
    ("of which precompile s", "r"),
    ("compile / stock (median of per-round ratios)", "r"),
    ("C++ kernels", "r"),
    ("steady step ms", "r"),
    ("step / stock", "r"),
    ("per-round compile s (load avg before→after)", "l"),
)


def markdown(result: dict[str, Any]) -> str:
    if "skipped" in result:
        return f"skipped: {result['skipped']}"
    rows = []
    for config, s in result["summary"].items():
        per_round = ", ".join(
            f"{r[config]['compile_s']:.1f} ({r[config]['load_before']}→{r[config]['load_after']})"
            for r in result["rounds"]
        )
        rows.append(
            [
                config,
                f"{s['compile_s']:.1f}",
                f"{s['precompile_s']:.1f}",
                f"{s['compile_ratio']:.2f}",
                f"{s['kernels']:.0f}",
                f"{s['step_s'] * 1e3:.1f}",
                f"{s['step_ratio']:.2f}",
                per_round,
            ]
        )
    head = (
        f"{result['model']}, {result['layers']} layers, dim {result['dim']}, seq "
        f"{result['seq']}, batch 2, fake PG (world 8); {result['repeats']} interleaved rounds, "
        "fresh Inductor cache dir per compile, Python bytecode warm; steady step = median of "
        f"{result['steps'] - 1}."
    )
    return f"{head}\n\n{markdown_table(_COLUMNS, rows)}"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        cfg, *nums = sys.argv[2:]
        layers, dim, seq, steps = (int(n) for n in nums)
        print(json.dumps(_worker(cfg, layers, dim, seq, steps)))
    else:
        import argparse

        parser = argparse.ArgumentParser(prog="python -m benchmarks.real_models_compile")
        parser.add_argument("--quick", action="store_true")
        parser.add_argument("--configs", default=",".join(CONFIGS))
        parser.add_argument("--json", type=Path)
        for key in FULL:
            parser.add_argument(f"--{key}", type=int)
        ns = parser.parse_args()
        sizes = {k: getattr(ns, k) for k in FULL if getattr(ns, k) is not None}
        result = run(ns.quick, tuple(ns.configs.split(",")), **sizes)
        if ns.json is not None:
            ns.json.write_text(json.dumps(result, indent=1))
        print(markdown(result))
