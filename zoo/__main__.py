"""``python -m zoo [--models a,b] [--configs default,ac,full] [--json PATH] [--md PATH]``.

Runs every model x configuration in its own subprocess (``zoo.worker``), one at a time, prints
one line per case, and writes the JSON record and the markdown table. A full run (every model,
every configuration) writes ``zoo/results.json`` and ``zoo/RESULTS.md`` unless told otherwise.
``stock`` is plain ``torch.compile`` (Inductor) of the same sharded train step: the reference gap
shown next to every model; bf16 models always get it (their numerics are judged against it).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ZOO_DIR = Path(__file__).resolve().parent
ROOT = ZOO_DIR.parent


def _parse_list(value: str, known: tuple[str, ...], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in known]
    if bad or not items:
        raise SystemExit(
            f"python -m zoo: unknown {what} {bad or value!r}; known: {', '.join(known)}"
        )
    return items


def _run_worker(
    model: str, configs: list[str], ranks: int, timeout: float, log_dir: Path
) -> list[dict[str, Any]]:
    """Run one model's cases in a ``zoo.worker`` subprocess; a case the worker never reported
    (crash, timeout) becomes an error record naming the cause."""
    out = log_dir / f"{model}.jsonl"
    log = log_dir / f"{model}.log"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "zoo.worker", model, ",".join(configs), "--ranks", str(ranks)]
    cmd += ["--out", str(out)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    with log.open("w") as fh:
        try:
            proc = subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout
            )
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    done: list[dict[str, Any]] = []
    if out.exists():
        done = [json.loads(ln) for ln in out.read_text().splitlines() if ln.strip()]
    if len(done) < len(configs):
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:]
        why = f"timeout after {timeout:.0f} s" if rc is None else f"worker exited with {rc}"
        for config in configs[len(done) :]:
            done.append(
                {
                    "model": model,
                    "config": config,
                    "ranks": ranks,
                    "error": f"{why}: {tail[0][:300] if tail else ''}",
                    "error_stage": "worker process",
                }
            )
            why, tail = "not run: an earlier case of this model ended the worker", []
    return done


def main(argv: list[str] | None = None) -> int:
    from zoo.models import BF16, MODELS
    from zoo.report import attach_stock_gaps, render
    from zoo.run import AP_CONFIGS, CONFIGS, CaseResult, evaluate

    parser = argparse.ArgumentParser(prog="python -m zoo", description=__doc__)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated (all)")
    parser.add_argument(
        "--configs",
        default=",".join(("stock", *AP_CONFIGS)),
        help=f"stock,default,ac,full (all four); also {','.join(CONFIGS[4:])}",
    )
    parser.add_argument("--ranks", type=int, default=1, choices=(1, 2), help="gloo ranks (1)")
    parser.add_argument("--json", default=None, help="JSON record (full run: zoo/results.json)")
    parser.add_argument("--md", default=None, help="markdown table (full run: zoo/RESULTS.md)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per case")
    parser.add_argument("--log-dir", default=None, help="per-case worker logs (a temp dir)")
    args = parser.parse_args(argv)

    models = _parse_list(args.models, tuple(MODELS), "model")
    configs = _parse_list(args.configs, CONFIGS, "config")
    full_run = set(models) == set(MODELS) and set(configs) >= set(AP_CONFIGS)
    json_path = args.json or (str(ZOO_DIR / "results.json") if full_run else None)
    md_path = args.md or (str(ZOO_DIR / "RESULTS.md") if full_run else None)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="zoo-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"[zoo] {len(models)} models x {configs}, {args.ranks} rank(s); logs in {log_dir}")

    command = "nice -n 10 uv run python -m zoo " + shlex.join(
        argv if argv is not None else sys.argv[1:]
    )
    results: list[CaseResult] = []
    start = time.perf_counter()
    for model in models:
        plan = list(configs)
        if model in BF16 and "stock" not in plan:
            plan = ["stock", *plan]
        elif "stock" in plan:
            plan = ["stock", *[c for c in plan if c != "stock"]]
        t0 = time.perf_counter()
        records = _run_worker(model, plan, args.ranks, args.timeout * len(plan), log_dir)
        cases = [CaseResult.from_dict(d) for d in records]
        results.extend(cases)
        attach_stock_gaps(results)
        for res in cases:
            verdict = (
                "reference"
                if res.config == "stock"
                else ", ".join(evaluate(res).failures()) or "ok"
            )
            err = f" [{res.error}]" if res.error else ""
            print(f"[zoo] {model:24s} {res.config:8s} {verdict}{err}", flush=True)
        print(f"[zoo] {model}: {time.perf_counter() - t0:.0f} s", flush=True)
    wall = time.perf_counter() - start
    attach_stock_gaps(results)
    if json_path:
        payload = {
            "command": command.strip(),
            "wall_s": wall,
            "cases": [r.to_dict() for r in results],
        }
        Path(json_path).write_text(json.dumps(payload, indent=1) + "\n")
        print(f"[zoo] wrote {json_path}")
    if md_path:
        Path(md_path).write_text(render(results, command=command.strip(), wall_s=wall))
        print(f"[zoo] wrote {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
