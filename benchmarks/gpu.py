"""Step time, peak memory, saved bytes and kernels of plain ``torch.compile`` against the ap
backend, per rank of an 8-way FSDP job on torch's fake process group (issue 35, item 4).

    uv run python -m benchmarks.gpu [--device cuda|cpu] [--quick] [--json PATH]

The model kit ``Transformer(ModelConfig(...), Sharding.from_world(gather_dtype=torch.bfloat16))``
under ``ap_testing.distributed.fake_world(8)``: collectives are no-ops, compute, kernels and
memory are real. Rows:

* ``plain``: ``torch.compile(model)``;
* ``plain_budget``: the same with ``torch._functorch.config.activation_memory_budget=0.5``
  (patched around this row's calls only);
* ``tagged_min_cut`` (``--rows`` only, not a default row): ``precompile`` +
  ``autoparallel_backend(partitioner="min_cut", bucketing=False)``, torch's min-cut on the
  tagged graph as the issue measured it (before bucketing was on by default);
* ``ap_default``: ``precompile`` + ``autoparallel_backend()``;
* ``ap_full``: ``precompile(..., joint_pass=ap_tags.ac_joint_pass())`` +
  ``autoparallel_backend(enable_ac=True, bucketing=True, overlap_scheduling=True)``;
* ``ap_budget``: ``precompile`` + ``autoparallel_backend(activation_budget_bytes=`` half of
  ``ap_default``'s (SaveAll's) saved bytes ``)``.

Columns: step time (``loss.backward()`` per step; median of ``steps`` steady steps after the
compiling step and ``warmup`` more; ``torch.cuda.synchronize`` around each on CUDA), peak memory
of one steady step (``reset_peak_memory_stats`` / ``max_memory_allocated``; CUDA only, ``n/a``
on CPU), saved bytes (ap rows: the backend's own ``SavedSummary`` of its partition; plain rows:
``ap_backend.measure_saved(model, ..., partitioner="min_cut", enable_ac=False)``, under the
row's budget patch for ``plain_budget``), generated kernels
(``torch._inductor.metrics.generated_kernel_count`` after the first forward + backward) and,
from ``torch.profiler`` over one steady step, kernels per step and kernel time:

* CUDA: every device-side event (kernels, memcpy, memset; not the ``record_function`` spans
  the profiler mirrors on the device timeline) and the sum of their durations;
* CPU: the Inductor C++ kernels (``cpp_fused_*``, recorded with
  ``torch._inductor.config.cpp.enable_kernel_profile``) plus every top-level ``aten::`` op (one
  with no ``aten::`` op above it: extern kernels such as ``mm``, fallbacks, the autograd
  engine's own ops), and the sum of their CPU times. This is a CPU analogue, not a GPU count.

The process sets ``TORCHINDUCTOR_FX_GRAPH_CACHE=0`` / ``TORCHINDUCTOR_AUTOGRAD_CACHE=0``
before importing torch when run as ``python -m benchmarks.gpu`` (a cache hit would skip the
ap partitioner and passes).
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before torch is imported, see the module docstring
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
    os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import ap_tags
import torch
from ap_backend import SavedSummary, autoparallel_backend, measure_saved, precompile
from ap_backend.models import ModelConfig, Sharding, Transformer
from ap_testing.distributed import fake_world
from torch import nn

from benchmarks import markdown_table

WORLD = 8

#: The issue's H100 shapes (``seq_len`` is swept, see :data:`CUDA_SEQS`).
CUDA_MODEL = ModelConfig(
    dim=2048,
    n_layers=8,
    n_heads=16,
    ffn_dim=5632,
    vocab=32000,
    seq_len=2048,
    batch=4,
    attention="sdpa",
)
CUDA_SEQS = (2048, 256)
CUDA_SEQS_QUICK = (256,)
#: The same code at CPU size (the issue's CPU table shape).
CPU_MODEL = ModelConfig(
    dim=256, n_layers=2, n_heads=4, ffn_dim=1024, vocab=1024, seq_len=512, batch=2
)
#: Seconds-sized shape (``--device cpu --quick`` and the test suite's smoke case).
TINY_MODEL = ModelConfig(dim=32, n_layers=1, n_heads=2, ffn_dim=64, vocab=64, seq_len=32)

#: (key, label), in run order (``ap_budget`` needs ``ap_default``'s saved bytes).
ROWS: tuple[tuple[str, str], ...] = (
    ("plain", "plain `torch.compile`"),
    ("plain_budget", "plain, `activation_memory_budget=0.5`"),
    ("tagged_min_cut", 'tagged min-cut (`partitioner="min_cut"`, unbucketed)'),
    ("ap_default", "`precompile` + `autoparallel_backend()`"),
    ("ap_full", "ap full (AC joint pass + AC + bucketing + overlap)"),
    ("ap_budget", "ap, `activation_budget_bytes` = SaveAll / 2"),
)

DEFAULT_ROWS = ("plain", "plain_budget", "ap_default", "ap_full", "ap_budget")


@dataclass(frozen=True)
class Settings:
    device: str
    steps: int = 10
    warmup: int = 2


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def _row_scope(key: str, device: str) -> Iterator[None]:
    """Settings in force for every call of one row (compiles happen on the first call)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with contextlib.ExitStack() as stack:
        if key == "plain_budget":
            stack.enter_context(functorch_config.patch(activation_memory_budget=0.5))
        if device == "cpu":  # name the C++ kernels in the profiler
            stack.enter_context(inductor_config.patch({"cpp.enable_kernel_profile": True}))
        yield


def _summary(s: SavedSummary) -> dict[str, int]:
    return {
        "saved_bytes": s.nbytes,
        "saved_tensors": s.count,
        "saved_ag": len(s.all_gather_outputs),
    }


def _is_kernel_event(event: Any, device: str) -> bool:
    from torch._C._autograd import DeviceType

    if device == "cuda":  # kernels, memcpy, memset; not the record_function spans
        return event.device_type == DeviceType.CUDA and not getattr(
            event, "is_user_annotation", False
        )
    if event.device_type != DeviceType.CPU:
        return False
    name: str = event.name
    if name.startswith("cpp_fused"):
        return True
    if not name.startswith("aten::"):
        return False
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return False
        parent = parent.cpu_parent
    return True


def profile_step(step: Callable[[], None], device: str) -> tuple[int, float]:
    """Kernels and their total time (ms) in one call of ``step`` (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        step()
        _sync(device)
    kernels = [e for e in prof.events() if _is_kernel_event(e, device)]
    return len(kernels), sum(e.time_range.elapsed_us() for e in kernels) / 1e3


def _compiled(
    key: str, model: nn.Module, batch: tuple[torch.Tensor, ...], budget: int | None
) -> tuple[Callable[..., torch.Tensor], Any]:
    """The compiled callable of row ``key`` and its ap backend (``None`` for plain rows)."""
    if key in ("plain", "plain_budget"):
        return torch.compile(model), None
    if key == "ap_full":
        pm = precompile(model, batch, joint_pass=ap_tags.ac_joint_pass())
        backend = autoparallel_backend(enable_ac=True, bucketing=True, overlap_scheduling=True)
    elif key == "tagged_min_cut":
        pm = precompile(model, batch)
        backend = autoparallel_backend(partitioner="min_cut", bucketing=False)
    elif key == "ap_budget":
        pm = precompile(model, batch)
        backend = autoparallel_backend(activation_budget_bytes=budget)
    else:
        pm = precompile(model, batch)
        backend = autoparallel_backend()
    return torch.compile(pm, backend=backend), backend


def measure_row(
    key: str,
    model: nn.Module,
    batch: tuple[torch.Tensor, ...],
    settings: Settings,
    budget: int | None = None,
) -> dict[str, Any]:
    """One row: compile, time, profile, count (see the module docstring)."""
    import torch._inductor.metrics as inductor_metrics

    device = settings.device
    torch.compiler.reset()
    inductor_metrics.reset()
    row: dict[str, Any] = {"key": key}
    with _row_scope(key, device):
        start = time.perf_counter()
        compiled, backend = _compiled(key, model, batch, budget)

        def step() -> None:
            loss = compiled(*batch)
            loss.backward()  # type: ignore[no-untyped-call]
            model.zero_grad(set_to_none=True)

        step()  # compiles the forward and (lazily) the backward
        _sync(device)
        row["compile_s"] = time.perf_counter() - start
        row["generated_kernels"] = int(inductor_metrics.generated_kernel_count)
        for _ in range(settings.warmup):
            step()
        times: list[float] = []
        for _ in range(settings.steps):
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            times.append(time.perf_counter() - start)
        row.update(
            step_ms=statistics.median(times) * 1e3,
            step_min_ms=min(times) * 1e3,
            step_max_ms=max(times) * 1e3,
        )
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            step()
            _sync(device)
            row["peak_bytes"] = int(torch.cuda.max_memory_allocated())
        else:
            row["peak_bytes"] = None
        row["kernels_per_step"], row["kernel_ms"] = profile_step(step, device)
        if backend is not None:
            if not backend.saved:
                raise RuntimeError(f"{key}: the backend partitioned nothing")
            row.update(_summary(backend.saved[-1]))
        else:
            torch.compiler.reset()
            row.update(
                _summary(measure_saved(model, batch, partitioner="min_cut", enable_ac=False))
            )
    if budget is not None:
        row["budget_bytes"] = budget
    return row


def measure_shape(cfg: ModelConfig, settings: Settings, rows: Sequence[str]) -> dict[str, Any]:
    """Every row of ``rows`` at one model shape (inside a fake world)."""
    device = torch.device(settings.device)
    model = Transformer(cfg, Sharding.from_world(gather_dtype=torch.bfloat16)).to(device)
    tokens, targets = model.example_batch(0, 0)
    batch = (tokens.to(device), targets.to(device))
    out: dict[str, Any] = {"shape": asdict(cfg), "rows": {}}
    if settings.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    for key in rows:
        budget = None
        if key == "ap_budget":
            default = out["rows"].get("ap_default")
            if default is None:  # measure SaveAll's bytes without its timing columns
                default = measure_row("ap_default", model, batch, replace(settings, steps=1))
            budget = int(default["saved_bytes"]) // 2
        out["rows"][key] = measure_row(key, model, batch, settings, budget)
        print(f"  {key}: {_row_line(out['rows'][key])}", file=sys.stderr, flush=True)
    return out


def _row_line(row: dict[str, Any]) -> str:
    return (
        f"step {row['step_ms']:.1f} ms, saved {row['saved_bytes']:,} B, "
        f"kernels {row['generated_kernels']} / {row['kernels_per_step']} per step"
    )


def _environment(device: str) -> dict[str, Any]:
    import platform

    card = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": device,
        "card": card,
        "torch": torch.__version__,
        "cores": os.cpu_count(),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def run(
    quick: bool = False,
    device: str = "cpu",
    rows: Sequence[str] = DEFAULT_ROWS,
    shapes: Sequence[ModelConfig] | None = None,
    steps: int | None = None,
) -> dict[str, Any]:
    """Every row at every shape of ``device`` (``--quick``: the small one only)."""
    if shapes is None:
        if device == "cuda":
            seqs = CUDA_SEQS_QUICK if quick else CUDA_SEQS
            shapes = [replace(CUDA_MODEL, seq_len=s) for s in seqs]
        else:
            shapes = [TINY_MODEL if quick else CPU_MODEL]
    settings = Settings(device, steps=steps or (3 if quick else 10), warmup=0 if quick else 2)
    env = _environment(device)
    results = []
    with fake_world(WORLD):
        for cfg in shapes:
            print(f"benchmarks.gpu: {cfg}", file=sys.stderr, flush=True)
            results.append(measure_shape(cfg, settings, rows))
    env["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return {"environment": env, "world": WORLD, "steps": settings.steps, "shapes": results}


_COLUMNS = (
    ("row", "l"),
    ("step ms (median; min-max)", "r"),
    ("peak GiB", "r"),
    ("saved bytes", "r"),
    ("saved tensors", "r"),
    ("all-gather outputs saved", "r"),
    ("generated kernels", "r"),
    ("kernels per step", "r"),
    ("kernel time ms", "r"),
)


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    cuda = env["device"] == "cuda"
    labels = dict(ROWS)
    parts = [
        f"{env['card']} ({env['device']}), torch {env['torch']}, {env['date']}, load average "
        f"{env['load_avg_at_start']} at start, {env.get('load_avg_at_end')} at end; fake PG "
        f"world {result['world']}, bf16 gathers; step = median of {result['steps']} steady "
        "steps; kernels per step / kernel time: "
        + (
            "device events of one steady step (torch.profiler)."
            if cuda
            else "C++ kernels + top-level aten ops of one steady step and their CPU time "
            "(torch.profiler; a CPU analogue). Peak memory: n/a on CPU."
        )
    ]
    for shape in result["shapes"]:
        s = shape["shape"]
        plain = shape["rows"].get("plain")
        parts.append(
            f"dim {s['dim']}, {s['n_layers']} layers, {s['n_heads']} heads, ffn {s['ffn_dim']}, "
            f"vocab {s['vocab']}, seq {s['seq_len']}, batch {s['batch']} "
            f"({s['seq_len'] * s['batch']} tokens per rank):"
        )
        table = []
        for key, row in shape["rows"].items():
            peak = row["peak_bytes"]
            ratio = ""
            if plain is not None and key != "plain":
                ratio = f" ({row['saved_bytes'] / plain['saved_bytes']:.2f}x plain)"
            table.append(
                [
                    labels[key],
                    f"{row['step_ms']:.1f}; {row['step_min_ms']:.1f}-{row['step_max_ms']:.1f}",
                    "n/a" if peak is None else f"{peak / 2**30:.2f}",
                    f"{row['saved_bytes']:,}{ratio}",
                    row["saved_tensors"],
                    row["saved_ag"],
                    row["generated_kernels"],
                    f"{row['kernels_per_step']:,}",
                    f"{row['kernel_ms']:.1f}",
                ]
            )
        parts.append(markdown_table(_COLUMNS, table))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="CUDA: S=256 only; CPU: tiny shape")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="comma-separated keys")
    parser.add_argument("--steps", type=int, help="steady steps to time (default 10)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device (use --device cpu)")
    rows = tuple(args.rows.split(","))
    unknown = set(rows) - {k for k, _ in ROWS}
    if unknown:
        parser.error(f"--rows: unknown {sorted(unknown)}")
    result = run(args.quick, args.device, rows, steps=args.steps)
    print(markdown(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
