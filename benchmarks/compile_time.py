"""Compile time as a user meets it (issue 42 item 5): Inductor's default compile threads, cold
and warm.

The model kit at 8 layers (dim 256, seq 256, batch 2, bf16 gathers, fake PG world 8), one fresh
process per compile (this module's ``--worker``: ``benchmarks.kernels``' compile, i.e.
``precompile`` + the first forward + the first backward - one steady step), configurations interleaved round by round (plain
``torch.compile``, ap default, ap full):

* **cold**: an empty Inductor cache directory of its own, Inductor's FX-graph and AOTAutograd
  caches on (as a user's job has them), Inductor's default compile-worker pool
  (``TORCHINDUCTOR_COMPILE_THREADS`` unset: C++ compiles in parallel, as a GPU's Triton
  compiles do -- the serialised compile of ``benchmarks.kernels`` hides the cost of ap's own
  passes behind fewer kernels);
* **warm**: the same job again on the directory the cold run filled (a restarted job); the
  table says what the caches did there (AOTAutograd hit / bypass, FX-graph hits).

Python bytecode is warm in both (``benchmarks.fresh_compile_env``).

    uv run python -m benchmarks.compile_time [--rounds N] [--layers L] [--json PATH]
        [--configs plain ap_default ap_full ap_full_prefetch]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from ap_backend.models import ModelConfig

from benchmarks import fresh_compile_env, run_worker
from benchmarks.kernels import COMPILE_CONFIGS, COMPILE_KIT, QUICK_KIT


def _env(cache: str, pycache: str) -> dict[str, str]:
    env = fresh_compile_env(cache, pycache)
    env.update(TORCHINDUCTOR_FX_GRAPH_CACHE="1", TORCHINDUCTOR_AUTOGRAD_CACHE="1")
    env.pop("TORCHINDUCTOR_COMPILE_THREADS", None)
    return env


def _compile(config: str, cfg: ModelConfig, cache: str, pycache: str) -> dict[str, Any]:
    out = run_worker(
        "benchmarks.compile_time", [config, json.dumps(asdict(cfg))], _env(cache, pycache)
    )
    print(f"  {config}: {out}", file=sys.stderr, flush=True)
    return out


def run(rounds: int, layers: int, configs: tuple[str, ...] = COMPILE_CONFIGS) -> dict[str, Any]:
    if configs[0] != "plain":
        raise ValueError(f"benchmarks.compile_time: the first config is plain's, got {configs}")
    cfg = replace(COMPILE_KIT, n_layers=layers)
    got: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="ap-compile-pycache-") as pycache:
        for config in configs:  # untimed: fills the bytecode every compile imports
            with tempfile.TemporaryDirectory(prefix="ap-compile-warmup-") as cache:
                _compile(config, QUICK_KIT, cache, pycache)
        for index in range(rounds):
            order = configs if index % 2 == 0 else tuple(reversed(configs))
            row: dict[str, dict[str, Any]] = {}
            for config in order:
                with tempfile.TemporaryDirectory(prefix="ap-compile-cache-") as cache:
                    cold = _compile(config, cfg, cache, pycache)
                    warm = _compile(config, cfg, cache, pycache)
                row[config] = {"cold": cold, "warm": warm}
            got.append(row)
    summary: dict[str, Any] = {}
    for config in configs:
        summary[config] = {}
        for phase in ("cold", "warm"):
            seconds = [r[config][phase]["compile_s"] for r in got]
            ratios = [r[config][phase]["compile_s"] / r["plain"][phase]["compile_s"] for r in got]
            summary[config][phase] = {
                "compile_s": statistics.median(seconds),
                "ratio": statistics.median(ratios),
                "per_round": [round(x, 2) for x in ratios],
                "precompile_s": statistics.median(r[config][phase]["precompile_s"] for r in got),
            }
    return {"shape": asdict(cfg), "rounds": got, "summary": summary}


def _caches(run: dict[str, Any]) -> str:
    caches: dict[str, int] = run.get("caches", {})
    return ", ".join(f"{k.split('.', 1)[1]} {v}" for k, v in sorted(caches.items()) if v) or "-"


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| config | cold s | cold vs plain (per round) | warm s | warm vs plain (per round) "
        "| warm caches (last round) |",
        "|---|---:|---|---:|---|---|",
    ]
    for config, s in result["summary"].items():
        cold, warm = s["cold"], s["warm"]
        lines.append(
            f"| {config} | {cold['compile_s']:.1f} | {cold['ratio']:.2f} {cold['per_round']} | "
            f"{warm['compile_s']:.1f} | {warm['ratio']:.2f} {warm['per_round']} | "
            f"{_caches(result['rounds'][-1][config]['warm'])} |"
        )
    return "\n".join(lines)


def _cache_counters() -> dict[str, int]:
    """Inductor's FX-graph and AOTAutograd cache hits, misses and bypasses of this process:
    what says whether a warm run was warm."""
    from torch._dynamo.utils import counters

    return {
        f"{group}.{name}": int(value)
        for group in ("inductor", "aot_autograd")
        for name, value in counters[group].items()
        if "cache" in name
    }


def _worker(config: str, shape: dict[str, Any]) -> dict[str, Any]:
    """One compile in this fresh process, with the caches the environment sets (on).

    Not ``python -m benchmarks.kernels --worker``: run as ``__main__`` that module switches
    Inductor's caches off (its compiles are cold by design), which made every "warm" run a
    cache miss that only reused the compiled C++ kernels."""
    from benchmarks.kernels import _worker as compile_once

    out = compile_once(config, ModelConfig(**shape), 2)
    out["caches"] = _cache_counters()
    return out


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(_worker(sys.argv[2], json.loads(sys.argv[3]))))
        return 0
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compile_time")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--json")
    parser.add_argument(
        "--configs", nargs="+", default=list(COMPILE_CONFIGS), help="plain first (the ratios')"
    )
    args = parser.parse_args(argv)
    result = run(args.rounds, args.layers, tuple(args.configs))
    print(markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
