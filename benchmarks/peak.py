"""Peak memory of one steady training step without a GPU (issue 42 item 4).

The CPU allocator keeps no peak statistic, so the step runs under
``torch.profiler.profile(activities=[CPU], profile_memory=True)`` and the peak is the largest
running sum of the profiler's CPU allocation events (``[memory]`` events: ``+bytes`` on
allocation, ``-bytes`` on free) in time order over that step: the bytes allocated during the
step and not yet freed, at their highest. Parameters, gradients' persistent buffers and the
optimizer are outside it (allocated before the step); everything the step allocates and frees
-- gathered weights, activations saved for the backward, gradients, workspace -- is in it.
This is the quantity a GPU's ``max_memory_allocated`` minus the memory held before the step
measures, and it shows the same sign (issue 42's H200 table: ap default above plain, and above
its own ``bucketing=False``, on both devices).

Rows (the model kit on a fake process group of world 8, bf16 gathers; each row compiles in its
own process so no allocator state is shared, and with its own Inductor cache unless
``--share-kernels`` lets the rows use the caller's for compiled kernels; never for graphs):

* ``plain``: ``torch.compile(model)``;
* ``ap_default``: ``precompile`` + ``autoparallel_backend()`` (copy-free buckets);
* ``ap_unbucketed``: the same with ``bucketing=False``;
* ``ap_full``: ``precompile(joint_pass=ac_joint_pass())`` + AC, bucketing, overlap;
* ``ap_modelwide`` (on request): the default with the bucketing of before issue 42
  (``BucketingConfig(block_buckets=False, prefetch_depth=None)``: buckets bounded by bytes and
  topological span only); ``ap_custom_ops`` (on request): the default with
  ``BucketingConfig()``'s flat ``"custom_ops"`` buckets, its form before it went copy-free;
  ``ap_coalesced`` / ``ap_full_coalesced`` (on request): the copy-free bucket form named
  explicitly, without ap's schedule (rows of ``benchmarks.gpu``, like every row here);
* ``ap_min_cut`` / ``ap_min_cut_unbucketed`` (on request): the default, and ``bucketing=False``,
  on ``precompile(first_partition="min_cut")`` (min-cut with torch's ban on recomputing what a
  backward matmul reads, the default first partition before stop 57);

plus, for torchtitan's Llama3 through the zoo's builder, ``plain``, ``ap_default`` and
``ap_unbucketed``; and on request (``--rows``) ap-bucketing alone on stock ``torch.compile``:
``stock_bucketed`` (``post_grad_custom_post_pass = OverlapBucketingPass(BucketingConfig())``,
no FQNs stamped: blocks from Dynamo's module paths) and ``stock_modelwide`` (the same with
``block_buckets=False``: what the pass bucketed there before it read those paths).

    uv run python -m benchmarks.peak [--shape kit_1024|kit_256|llama3|quick] [--rows ...]
"""

from __future__ import annotations

import os

if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: name -> (description, builder arguments)
SHAPES: dict[str, dict[str, Any]] = {
    # issue 42's CPU shape: the H200 kit (16 heads, ffn 5632, vocab 32000) at dim 1024
    "kit_1024": {
        "model": "kit",
        "dim": 1024,
        "n_layers": 8,
        "n_heads": 16,
        "ffn_dim": 5632,
        "vocab": 32000,
        "seq_len": 256,
        "batch": 2,
    },
    # issue 35's kernel-count kit (benchmarks.kernels.KIT)
    "kit_256": {
        "model": "kit",
        "dim": 256,
        "n_layers": 2,
        "n_heads": 4,
        "ffn_dim": 1024,
        "vocab": 1024,
        "seq_len": 512,
        "batch": 2,
    },
    "llama3": {"model": "tt_llama3", "n_layers": 4, "dim": 256, "seq": 1024},
    # weights a large share of the peak: a bucket wider than a block shows
    "weights": {
        "model": "kit",
        "dim": 256,
        "n_layers": 4,
        "n_heads": 4,
        "ffn_dim": 1024,
        "vocab": 1024,
        "seq_len": 32,
        "batch": 2,
    },
    "quick": {
        "model": "kit",
        "dim": 64,
        "n_layers": 2,
        "n_heads": 4,
        "ffn_dim": 128,
        "vocab": 128,
        "seq_len": 64,
        "batch": 2,
    },
}
KIT_ROWS = ("plain", "ap_default", "ap_unbucketed", "ap_full", "ap_full_prefetch")
LLAMA_ROWS = ("plain", "ap_default", "ap_unbucketed")
#: ap-bucketing alone on stock ``torch.compile``, as a trainer that depends on nothing else
#: of this workspace uses it (``post_grad_custom_post_pass = OverlapBucketingPass(...)``, no
#: module FQNs stamped: the blocks come from Dynamo's module paths); ``stock_modelwide`` is
#: the bucketing the pass gave there before it read those paths (one bucket per direction,
#: bounded by bytes and span)
STOCK_ROWS = ("stock_bucketed", "stock_modelwide")


def step_peak_bytes(step: Callable[[], None]) -> int:
    """Largest running sum of the CPU allocation events of one call of ``step``."""
    from torch._C._autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    # the raw allocator events (``[memory]``: +bytes allocated, -bytes freed), each stamped
    kineto = prof.profiler.kineto_results if prof.profiler is not None else None
    assert kineto is not None
    events = [
        (e.start_ns(), e.nbytes())
        for e in kineto.events()
        if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
    ]
    events.sort(key=lambda e: e[0])
    alive = peak = 0
    for _, nbytes in events:
        alive += nbytes
        peak = max(peak, alive)
    return peak


def _build(shape: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
    import torch

    if shape["model"] == "kit":
        from ap_backend.models import ModelConfig, Sharding, Transformer

        cfg = ModelConfig(**{k: v for k, v in shape.items() if k != "model"})
        model = Transformer(cfg, Sharding.from_world(gather_dtype=torch.bfloat16))
        return model, model.example_batch(0, 0)
    from benchmarks.real_models import build_step

    return build_step(
        shape["model"], {k: v for k, v in shape.items() if k in ("n_layers", "dim", "seq")}
    )


def _stock_pass(row: str) -> Any:
    """The post-grad pass of a ``STOCK_ROWS`` row."""
    from ap_bucketing import BucketingConfig, OverlapBucketingPass

    if row == "stock_modelwide":
        return OverlapBucketingPass(BucketingConfig(block_buckets=False, prefetch_depth=None))
    return OverlapBucketingPass(BucketingConfig())


def measure(shape_name: str, row: str, steps: int = 3) -> dict[str, Any]:
    """Compile row ``row`` at ``shape_name`` in this process (fake PG world 8) and measure the
    peak of its last steady step."""
    import torch
    import torch._inductor.metrics as inductor_metrics
    from ap_testing.distributed import fake_world

    from benchmarks.gpu import _compiled

    torch.manual_seed(0)
    with fake_world(8):
        model, batch = _build(SHAPES[shape_name])
        inductor_metrics.reset()
        start = time.perf_counter()
        compiled: Callable[..., Any]
        backend: Any
        with contextlib.ExitStack() as stack:
            inner = getattr(model, "model", None)
            if row in STOCK_ROWS:
                # the whole run: the backward compiles lazily, at the first step
                stack.enter_context(
                    torch._inductor.config.patch(post_grad_custom_post_pass=_stock_pass(row))
                )
                compiled, backend = torch.compile(model), None
            else:
                if isinstance(inner, torch.nn.Module):
                    # the zoo's FsdpTrainStep hides its model from named_modules();
                    # precompile records module FQNs (what block-wide buckets key on) through
                    # this, as the zoo's EP route does
                    from ap_tags import annotate_module_fqns

                    with annotate_module_fqns(inner):
                        compiled, backend = _compiled(row, model, batch, None)
                else:
                    compiled, backend = _compiled(row, model, batch, None)

            def step() -> None:
                loss = compiled(*batch)
                loss.backward()
                model.zero_grad(set_to_none=True)

            step()
            compile_s = time.perf_counter() - start
            for _ in range(steps - 1):
                step()
            peak = step_peak_bytes(step)
    out: dict[str, Any] = {
        "shape": shape_name,
        "row": row,
        "peak_bytes": peak,
        "kernels": int(inductor_metrics.generated_kernel_count),
        "compile_s": compile_s,
    }
    if backend is not None and getattr(backend, "saved", None):
        out["saved_bytes"] = backend.saved[-1].nbytes
    return out


def _spawn(shape: str, row: str, share_kernels: bool = False) -> dict[str, Any]:
    """One row in a fresh process, with an Inductor cache directory of its own; with
    ``share_kernels``, the caller's (``TORCHINDUCTOR_CACHE_DIR`` as inherited: under pytest
    the session's directory, which every test's compiles already share) with the graph caches
    off, so only compiled kernels are shared."""
    with tempfile.TemporaryDirectory(prefix="ap-peak-") as tmp:
        out = Path(tmp) / "row.json"
        env = dict(os.environ)
        if share_kernels:
            # an FX-graph or AOTAutograd hit would skip the row's own partitioner and passes
            env.update(TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
        else:
            env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")
            env.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
            env.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
        cmd = [sys.executable, "-m", "benchmarks.peak", "--worker", shape, row, str(out)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"benchmarks.peak {shape}/{row} failed:\n{proc.stderr[-4000:]}")
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def run(
    shapes: list[str], rows: list[str] | None = None, *, share_kernels: bool = False
) -> list[dict[str, Any]]:
    """Every row of every shape, each in its own process (``share_kernels``: see
    :func:`_spawn`; peaks and kernel counts are the same, "compile s" is then no cold
    compile)."""
    results = []
    for shape in shapes:
        wanted = rows or list(LLAMA_ROWS if SHAPES[shape]["model"] != "kit" else KIT_ROWS)
        by_row = {row: _spawn(shape, row, share_kernels) for row in wanted}
        plain = by_row.get("plain", {}).get("peak_bytes")
        unbucketed = by_row.get("ap_unbucketed", {}).get("peak_bytes")
        for result in by_row.values():
            if plain:
                result["vs_plain"] = result["peak_bytes"] / plain
            if unbucketed:
                result["vs_unbucketed"] = result["peak_bytes"] / unbucketed
            results.append(result)
    return results


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| shape | row | peak MiB | vs plain | vs bucketing=False | kernels | compile s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['shape']} | {r['row']} | {r['peak_bytes'] / 2**20:,.1f} | "
            f"{r.get('vs_plain', float('nan')):.2f} | {r.get('vs_unbucketed', float('nan')):.2f} "
            f"| {r['kernels']} | {r['compile_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peak")
    parser.add_argument("--worker", nargs=3, metavar=("SHAPE", "ROW", "OUT"))
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES))
    parser.add_argument("--rows", nargs="*")
    parser.add_argument("--json")
    parser.add_argument(
        "--share-kernels",
        action="store_true",
        help="rows compile into the caller's Inductor cache directory and share its kernels "
        "(faster; graphs are never cached, so peaks and kernel counts are unchanged, compile "
        "s is not cold)",
    )
    args = parser.parse_args(argv)
    if args.worker:
        shape, row, out = args.worker
        Path(out).write_text(json.dumps(measure(shape, row)))
        return 0
    results = run(
        args.shape or ["kit_256", "kit_1024", "llama3"], args.rows, share_kernels=args.share_kernels
    )
    print(markdown(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
