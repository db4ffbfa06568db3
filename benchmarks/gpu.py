"""Step time, peak memory, saved bytes, kernels and compile time of plain ``torch.compile``
against the ap backend, per rank of an 8-way FSDP job on torch's fake process group (issue 35,
item 4), sized for a lent GPU machine (issue 42, item 6).

    uv run python -m benchmarks.gpu [--device cuda|cpu] [--quick] [--json PATH] [--budget-s S]
                                    [--rows KEY,...] [--rounds N] [--warm|--no-warm]

The model kit ``Transformer(ModelConfig(...), Sharding.from_world(gather_dtype=torch.bfloat16))``
under ``ap_testing.distributed.fake_world(8)``: collectives are no-ops, compute, kernels and
memory are real.

Shapes (``--dim/--layers/--seq/--batch`` override any of them):

* ``--device cuda``: the issue's shape, dim 2048, 8 layers, 16 heads, ffn 5632, vocab 32000,
  seq 2048, batch 4, ``attention="sdpa"`` (8,192 tokens per rank);
* ``--device cuda --quick``: dim 1024, 2 layers, 8 heads, ffn 2816, vocab 32000, seq 1024,
  batch 2. Two layers keep every compile short (compile time grows with the layer count; the
  kernels repeat), while 2,048 tokens per rank keep what the memory columns claim: below that
  torch's min-cut and ``default_partition`` trade places (docs/architecture.md, "Why the first
  partition is min-cut"), and the issue's CPU peaks were measured at >= 2,048 tokens too;
* ``--device cpu``: dim 256, 2 layers, seq 512, batch 2 (issue 35's CPU shape);
* ``--device cpu --quick``: dim 32, 1 layer, seq 32 (seconds per compile; the test suite's
  smoke case).

Rows (``--rows``; default: the issue's six on CUDA and on ``--device cpu``, ``plain,
ap_default`` with ``--device cuda --quick``, ``plain,ap_default,ap_budget`` with ``--device cpu
--quick``):

* ``plain``: ``torch.compile(model)``;
* ``plain_budget``: the same with ``torch._functorch.config.activation_memory_budget=0.5``;
* ``ap_default``: ``precompile`` + ``autoparallel_backend()``;
* ``ap_unbucketed``: the same with ``autoparallel_backend(bucketing=False)``;
* ``ap_budget``: ``precompile`` + ``autoparallel_backend(activation_budget_bytes=`` half of
  SaveAll's saved bytes ``)``: ``ap_default``'s measured bytes when that row ran earlier in the
  run, else half of ``precompile``'s first partition (what SaveAll replays);
* ``ap_full``: ``precompile(..., joint_pass=ap_tags.ac_joint_pass())`` +
  ``autoparallel_backend(enable_ac=True, bucketing=True, overlap_scheduling=True)``;
* ``tagged_min_cut`` (only by name): ``precompile`` + ``autoparallel_backend(partitioner=
  "min_cut", bucketing=False)``, issue 35's unbucketed tagged min-cut.

**One fresh process per row, each with its own caches.** The runner (:func:`execute`; ``run``
for the suite) starts every row as ``python -m benchmarks.gpu --worker SPEC`` with
``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` set to new directories of that row and
round, and Inductor's FX-graph and AOTAutograd caches on. So every row's first step is a cold
compile (empty caches, a fresh compile-worker pool, nothing imported), comparable between rows;
no row inherits another's kernels. With ``--rounds N`` the rows repeat interleaved (round 1 in
``--rows`` order, round 2 reversed, ...), each round in new directories. The warm column
(``--warm``, default on for the full shapes) re-runs each row's process on the directories its
cold run filled: the second run of the same job with caches on, as a restarted training job sees
it (``precompile`` is not cached and runs again). Warm runs come after every cold run, so the
budget drops them first.
Where ``PYTHONDONTWRITEBYTECODE`` is set (this 2-core machine), the workers share a bytecode
directory (``PYTHONPYCACHEPREFIX`` under the temp dir, filled by the first worker of the first
run), as an installed torch reads its ``.pyc`` files.

**Budget.** The runner knows its deadline: ``--budget-s`` (default 450 s for ``--device cuda``,
90 s for ``--device cuda --quick``, none on CPU) counted from the start of this module, or an
absolute ``--deadline`` (``time.time()``, what ``scripts/gpu-check`` passes). Before each
worker it estimates the worker's seconds (the same row's earlier run; else the measured
workers' process overhead plus their first steps scaled by :data:`COST`, the rows' relative
first-step times on the H200; nothing before the first worker) and skips it with
``not run: budget (...)`` when it would not fit; a worker still running at the deadline is
stopped (its process group) and reported ``stopped: budget``. The table of what ran is printed
either way, and ``--json`` is rewritten after every worker, so a killed runner leaves its rows.

Columns: step time (``loss.backward()`` per step; median of ``steps`` steady steps after the
compiling step and ``warmup`` more; ``torch.cuda.synchronize`` around each on CUDA), peak
memory of one steady step (``reset_peak_memory_stats`` / ``max_memory_allocated``; CUDA only,
``n/a`` on CPU), saved for backward (ap rows: the backend's own ``SavedSummary`` of its
partition; plain rows: ``ap_backend.measure_saved(model, ..., partitioner="min_cut",
enable_ac=False)``, under the row's budget patch for ``plain_budget``; the number of
all-gather outputs among them), kernels per step and kernel time per step from
``torch.profiler`` over ``profile_steps`` steady steps, generated kernels
(``torch._inductor.metrics.generated_kernel_count`` after the first forward + backward), first
step s (``precompile`` + the first forward + backward, synchronized: the compile a user waits
for) and warm first step s (the same in the warm run). Kernels on each device:

* CUDA: every device-side event (kernels, memcpy, memset; not the ``record_function`` spans
  the profiler mirrors on the device timeline) and the sum of their durations;
* CPU: the Inductor C++ kernels (``cpp_fused_*``, recorded with
  ``torch._inductor.config.cpp.enable_kernel_profile``) plus every top-level ``aten::`` op (one
  with no ``aten::`` op above it: extern kernels such as ``mm``, fallbacks, the autograd
  engine's own ops) and each collective call (``_c10d_functional::``) as one, not the process
  group's host-side work inside it, and the sum of their CPU times. This is a CPU analogue,
  not a GPU count.

GFLOP / step: the FLOPs of the ops ``torch.utils.flop_counter`` has a formula for and can
apply to the shapes the profiler records on the host (``record_shapes``): matmuls and
attention (a convolution's formula needs its output shape, which is not recorded: it logs a
warning and counts 0), each such op with none above it, over the same profiled steps. It
holds on any device, so the compute a row's recomputation adds is measured on CPU too (ratio
to plain's in brackets). Its formulas count causal attention as full attention.

A second table lists every worker: round, cold or warm, process id, wall seconds (start to
exit, imports included), its cache directory and the FX-graph / AOTAutograd cache hits and
misses it counted (a cold run has no hit; a warm one should).

On a lent GPU (torch 2.11+ with CUDA there, no registry; benchmarks/RESULTS.md, "GPU", has
the whole recipe and a sample of the output):

    scripts/gpu-check build                          # here, where uv is: .whl/ (ignored by git)
    # on the GPU machine, from this checkout with .whl/ carried along, one command:
    python3 scripts/gpu-check run --device cuda --json $OUT/gpu.json   # < 9 min
    python3 scripts/gpu-check run --device cuda --quick                # < 2 min (a smoke check)

Expected seconds per worker on an H100 or H200 (compile is host-bound; issue 42's H200
first-step seconds, plus about 8 s of process start, imports, model, timed steps and profiler,
plus about 10 s of ``measure_saved`` in the plain rows): cold plain ~41, plain_budget ~40,
ap_default ~56, ap_unbucketed ~40, ap_budget ~62, ap_full ~64 (~300 s); warm plain rows ~12,
ap rows ~28 (``precompile`` and the backend's partition run again; ~140 s). With the runner's
own start, ~450 s: the default budget drops the last warm runs when the machine is slower.
``--quick`` (2 layers, 2 rows, 1 + 5 steps): ~20 s + ~25 s.
"""

from __future__ import annotations

import time

_T0 = time.time()  # the --budget-s clock starts here, before torch is imported

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from dataclasses import asdict, dataclass, field, replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import ap_bucketing  # noqa: E402
import ap_tags  # noqa: E402
import torch  # noqa: E402
from ap_backend import SavedSummary, autoparallel_backend, measure_saved, precompile  # noqa: E402
from ap_backend.models import ModelConfig, Sharding, Transformer  # noqa: E402
from ap_testing.distributed import fake_world  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks import markdown_table  # noqa: E402

log = logging.getLogger(__name__)

WORLD = 8
ROOT = Path(__file__).resolve().parent.parent

#: The issue's shape (issue 42, "What was measured").
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
#: ``--device cuda --quick``: 2,048 tokens per rank, two layers (see the module docstring).
CUDA_QUICK_MODEL = ModelConfig(
    dim=1024,
    n_layers=2,
    n_heads=8,
    ffn_dim=2816,
    vocab=32000,
    seq_len=1024,
    batch=2,
    attention="sdpa",
)
#: The same code at CPU size (issue 35's CPU table shape).
CPU_MODEL = ModelConfig(
    dim=256, n_layers=2, n_heads=4, ffn_dim=1024, vocab=1024, seq_len=512, batch=2
)
#: Seconds-sized shape (``--device cpu --quick`` and the test suite's smoke case).
TINY_MODEL = ModelConfig(dim=32, n_layers=1, n_heads=2, ffn_dim=64, vocab=64, seq_len=32)

#: (key, label), in the issue's table order.
ROWS: tuple[tuple[str, str], ...] = (
    ("plain", "plain `torch.compile`"),
    ("plain_budget", "plain, `activation_memory_budget=0.5`"),
    ("tagged_min_cut", 'tagged min-cut (`partitioner="min_cut"`, unbucketed)'),
    ("ap_default", "`precompile` + `autoparallel_backend()`"),
    ("ap_unbucketed", "the same, `bucketing=False`"),
    ("ap_budget", "`activation_budget_bytes=` half of SaveAll's"),
    ("ap_full", "full: `precompile(joint_pass=ac_joint_pass())` + AC, bucketing, overlap"),
    ("ap_prefetch", '`overlap_scheduling="prefetch"` (ap\'s FSDP schedule, copy-free buckets)'),
    (
        "ap_full_prefetch",
        'full, `overlap_scheduling="prefetch"` (ap\'s FSDP schedule, copy-free buckets)',
    ),
    # on request only (benchmarks.peak's comparisons): the bucketing of before issue 42, the
    # default's bucket form before it went copy-free, and the copy-free form named explicitly
    ("ap_modelwide", "model-wide buckets (`block_buckets=False`, no prefetch window)"),
    ("ap_custom_ops", '`bucketing=BucketingConfig()` (`"custom_ops"`: flat buckets, copies)'),
    ("ap_coalesced", '`bucketing=BucketingConfig(bucket_mode="coalesced")` (the default\'s form)'),
    ("ap_full_coalesced", 'AC + `BucketingConfig(bucket_mode="coalesced")`, no overlap scheduler'),
    # on request: the first partition with torch's ban on recomputing what a backward matmul
    # reads (``precompile(first_partition="min_cut")``, the default before stop 57), bucketed
    # and not: the default's extra backward writes against the bytes they free
    ("ap_min_cut", '`precompile(first_partition="min_cut")` + `autoparallel_backend()`'),
    ("ap_min_cut_unbucketed", "the same, `bucketing=False`"),
)
#: The issue's six rows (``ap_budget`` after ``ap_default``, whose saved bytes it halves).
ISSUE_ROWS = ("plain", "plain_budget", "ap_default", "ap_unbucketed", "ap_budget", "ap_full")
CUDA_QUICK_ROWS = ("plain", "ap_default")
#: three, not five: each row compiles cold in its own cache dir, about 30 s of C++ compile per
#: row on the 2-core machine (Inductor's precompiled header and every kernel, once per row)
CPU_QUICK_ROWS = ("plain", "ap_default", "ap_budget")
#: kept for ``benchmarks.kernels`` and older callers
DEFAULT_ROWS = ISSUE_ROWS

#: Relative seconds of one cold row (its first step on the H200 over plain's, issue 42:
#: 22.8, 22.2, 45.5, 31.6, 53.7, 56.2 s), for the budget's estimate of a row not yet measured.
COST = {
    "plain": 1.0,
    "plain_budget": 1.0,
    "tagged_min_cut": 1.4,
    "ap_default": 2.0,
    "ap_unbucketed": 1.4,
    "ap_budget": 2.4,
    "ap_full": 2.5,
    "ap_prefetch": 2.0,
    "ap_full_prefetch": 2.5,
    # not measured on a GPU yet: the default's and the unbucketed row's
    "ap_min_cut": 2.0,
    "ap_min_cut_unbucketed": 1.4,
}
#: A warm run's seconds over its cold run's, until one warm run is measured.
WARM_GUESS = 0.7
#: Seconds kept back from the deadline for the table and the JSON.
RESERVE_S = 3.0


@dataclass(frozen=True)
class Settings:
    device: str
    steps: int = 10
    warmup: int = 2
    profile_steps: int = 1


@dataclass(frozen=True)
class Plan:
    """What one ``run`` measures (see :func:`plan_for` for the defaults)."""

    settings: Settings
    shape: ModelConfig
    rows: tuple[str, ...]
    rounds: int = 1
    warm: bool = False
    budget_s: float | None = None
    compile_threads: int | None = None


def plan_for(
    device: str,
    quick: bool,
    rows: Sequence[str] | None = None,
    shape: ModelConfig | None = None,
    steps: int | None = None,
    rounds: int = 1,
    warm: bool | None = None,
    budget_s: float | None = -1.0,
    compile_threads: int | None = None,
) -> Plan:
    """The defaults of ``device`` / ``quick``; ``budget_s=-1`` picks the default budget."""
    if device == "cuda":
        default_shape = CUDA_QUICK_MODEL if quick else CUDA_MODEL
        default_rows: tuple[str, ...] = CUDA_QUICK_ROWS if quick else ISSUE_ROWS
        settings = (
            Settings(device, steps=5, warmup=1, profile_steps=1)
            if quick
            else Settings(device, steps=10, warmup=2, profile_steps=3)
        )
        default_budget: float | None = 90.0 if quick else 450.0
    else:
        default_shape = TINY_MODEL if quick else CPU_MODEL
        default_rows = CPU_QUICK_ROWS if quick else ISSUE_ROWS
        settings = (
            Settings(device, steps=3, warmup=0, profile_steps=1)
            if quick
            else Settings(device, steps=10, warmup=2, profile_steps=1)
        )
        default_budget = None
    if steps is not None:
        settings = replace(settings, steps=steps)
    return Plan(
        settings=settings,
        shape=shape or default_shape,
        rows=tuple(rows or default_rows),
        rounds=rounds,
        warm=(not quick) if warm is None else warm,
        budget_s=default_budget if budget_s == -1.0 else budget_s,
        compile_threads=compile_threads,
    )


# ---------------------------------------------------------------------------------------------
# one row, inside a worker process


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


#: host-side events of a process group's collective: its call and the backend's own work
_COLLECTIVE_PREFIXES = ("_c10d_functional::", "c10d::")


def _is_collective_event(name: str) -> bool:
    return name.startswith(_COLLECTIVE_PREFIXES)


def _is_kernel_event(event: Any, device: str) -> bool:
    """A kernel of one step (see the module docstring). On CPU a collective is one launch:
    the host-side work of the process group behind it (the fake and gloo backends chunk and
    copy per member and per rank: 144 ``aten::copy_`` in one coalesced all-gather of the
    tiny kit) is the backend's, as NCCL's grouped launch is one device kernel."""
    from torch._C._autograd import DeviceType

    if device == "cuda":  # kernels, memcpy, memset; not the record_function spans
        return event.device_type == DeviceType.CUDA and not getattr(
            event, "is_user_annotation", False
        )
    if event.device_type != DeviceType.CPU:
        return False
    name: str = event.name
    if not (name.startswith(("cpp_fused", "aten::")) or _is_collective_event(name)):
        return False
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::") or _is_collective_event(parent.name):
            return False
        parent = parent.cpu_parent
    return True


def _formula(event: Any) -> Any | None:
    """``torch.utils.flop_counter``'s FLOP formula for a host-side ``aten::`` event's op."""
    from torch._C._autograd import DeviceType
    from torch.utils.flop_counter import flop_registry

    if event.device_type != DeviceType.CPU or not event.name.startswith("aten::"):
        return None
    packet = getattr(torch.ops.aten, event.name.removeprefix("aten::"), None)
    return None if packet is None else flop_registry.get(packet)


def _counted_once(event: Any) -> bool:
    """An op with a FLOP formula and none above it: what compiled code calls (an extern
    ``mm``, an attention op) counted once. Eager CUDA attention nests one op with a formula
    in another (``_flash_attention_forward`` in ``_scaled_dot_product_flash_attention``):
    only the outer counts. The ``mm`` inside an eager ``matmul`` (no formula) counts."""
    if _formula(event) is None:
        return False
    parent = event.cpu_parent
    while parent is not None:
        if _formula(parent) is not None:
            return False
        parent = parent.cpu_parent
    return True


def _event_args(event: Any) -> list[object]:
    """The op's positional arguments as the profiler recorded them (``record_shapes``):
    tensors as meta tensors of their shapes, scalars as the concrete values, else None."""
    shapes = list(event.input_shapes or [])
    concrete = list(getattr(event, "concrete_inputs", None) or [])
    types = list(getattr(event, "input_dtypes", None) or [])
    args: list[object] = []
    for i, shape in enumerate(shapes):
        kind = types[i] if i < len(types) else ""
        if shape and kind not in ("Scalar", "ScalarList", "GenericList", "TensorList"):
            args.append(torch.empty(shape, device="meta"))
        else:
            args.append(concrete[i] if i < len(concrete) and concrete[i] != "" else None)
    return args


def event_flops(event: Any) -> int | None:
    """FLOPs of one top-level op by ``torch.utils.flop_counter``'s formula for it (from the
    shapes the profiler recorded), 0 for an op it has no formula for, None when the formula
    cannot read the recorded arguments."""
    formula = _formula(event)
    if formula is None:
        return 0
    try:
        return int(formula(*_event_args(event), out_val=None))
    except Exception:  # a formula that needs an argument the profiler did not record
        return None


def profile_step(
    step: Callable[[], None], device: str, steps: int = 1
) -> tuple[float, float, float]:
    """Kernels, their total time (ms) and the GFLOPs of the ops with a FLOP formula (matmuls,
    attention) per call of ``step``, over ``steps`` calls (see the module docstring), from
    one walk of the profiled events. The FLOPs count what ran, recomputation included, on any
    device: the part of a step's time that does not depend on memory bandwidth or launches."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    kernels, kernel_us, flops = 0, 0.0, 0
    for event in prof.events():
        if _is_kernel_event(event, device):
            kernels += 1
            kernel_us += event.time_range.elapsed_us()
        if _counted_once(event):
            counted = event_flops(event)
            if counted is None:
                log.warning("benchmarks.gpu: no FLOP count for %s", event.name)
            flops += counted or 0
    return kernels / steps, kernel_us / 1e3 / steps, flops / 1e9 / steps


def _make(
    key: str, model: nn.Module, batch: tuple[torch.Tensor, ...], budget: int | None
) -> tuple[Callable[..., torch.Tensor], Any, int | None]:
    """Row ``key``'s compiled callable, its ap backend (``None`` for plain rows) and the
    activation budget it got (``ap_budget`` only; ``None`` picks half of the first partition)."""
    if key in ("plain", "plain_budget"):
        return torch.compile(model), None, None
    if key == "ap_full":
        pm = precompile(model, batch, joint_pass=ap_tags.ac_joint_pass())
        backend = autoparallel_backend(enable_ac=True, bucketing=True, overlap_scheduling=True)
    elif key == "ap_prefetch":
        pm = precompile(model, batch)
        backend = autoparallel_backend(overlap_scheduling="prefetch")
    elif key == "ap_full_prefetch":
        pm = precompile(model, batch, joint_pass=ap_tags.ac_joint_pass())
        backend = autoparallel_backend(enable_ac=True, overlap_scheduling="prefetch")
    elif key == "tagged_min_cut":
        pm = precompile(model, batch)
        backend = autoparallel_backend(partitioner="min_cut", bucketing=False)
    elif key == "ap_unbucketed":
        pm = precompile(model, batch)
        backend = autoparallel_backend(bucketing=False)
    elif key == "ap_budget":
        pm = precompile(model, batch)
        if budget is None:  # what SaveAll replays: the first partition
            budget = pm.first_partition.nbytes // 2
        backend = autoparallel_backend(activation_budget_bytes=budget)
    elif key == "ap_default":
        pm = precompile(model, batch)
        backend = autoparallel_backend()
    elif key in ("ap_min_cut", "ap_min_cut_unbucketed"):
        pm = precompile(model, batch, first_partition="min_cut")
        bucketed = key == "ap_min_cut"
        backend = autoparallel_backend() if bucketed else autoparallel_backend(bucketing=False)
    elif key == "ap_custom_ops":
        pm = precompile(model, batch)
        backend = autoparallel_backend(bucketing=ap_bucketing.BucketingConfig())
    elif key == "ap_modelwide":
        pm = precompile(model, batch)
        modelwide = ap_bucketing.BucketingConfig(block_buckets=False, prefetch_depth=None)
        backend = autoparallel_backend(bucketing=modelwide)
    elif key in ("ap_coalesced", "ap_full_coalesced"):
        full = key == "ap_full_coalesced"
        pm = precompile(model, batch, joint_pass=ap_tags.ac_joint_pass() if full else None)
        coalesced = ap_bucketing.BucketingConfig(bucket_mode="coalesced")
        backend = autoparallel_backend(bucketing=coalesced, enable_ac=full)
    else:
        raise ValueError(f"benchmarks.gpu: unknown row {key!r}")
    return torch.compile(pm, backend=backend), backend, budget


def _compiled(
    key: str, model: nn.Module, batch: tuple[torch.Tensor, ...], budget: int | None
) -> tuple[Callable[..., torch.Tensor], Any]:
    """The compiled callable of row ``key`` and its ap backend (``None`` for plain rows)."""
    compiled, backend, _ = _make(key, model, batch, budget)
    return compiled, backend


def measure_row(
    key: str,
    model: nn.Module,
    batch: tuple[torch.Tensor, ...],
    settings: Settings,
    budget: int | None = None,
    *,
    compile_only: bool = False,
) -> dict[str, Any]:
    """One row: compile, time, profile, count (see the module docstring). ``compile_only``:
    the first step and nothing after it (the warm run)."""
    import torch._inductor.metrics as inductor_metrics

    device = settings.device
    torch.compiler.reset()
    inductor_metrics.reset()
    row: dict[str, Any] = {"key": key}
    with _row_scope(key, device):
        start = time.perf_counter()
        compiled, backend, budget = _make(key, model, batch, budget)
        # ap rows: ``precompile``; plain rows: the ``torch.compile`` call (imports, mostly)
        row["precompile_s"] = time.perf_counter() - start

        def step() -> None:
            loss = compiled(*batch)
            loss.backward()  # type: ignore[no-untyped-call]
            model.zero_grad(set_to_none=True)

        step()  # compiles the forward and (lazily) the backward
        _sync(device)
        row["compile_s"] = time.perf_counter() - start
        row["generated_kernels"] = int(inductor_metrics.generated_kernel_count)
        if budget is not None:
            row["budget_bytes"] = budget
        if compile_only:
            return row
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
        row["kernels_per_step"], row["kernel_ms"], row["gflops_per_step"] = profile_step(
            step, device, settings.profile_steps
        )
        if backend is not None:
            if not backend.saved:
                raise RuntimeError(f"{key}: the backend partitioned nothing")
            row.update(_summary(backend.saved[-1]))
        else:
            torch.compiler.reset()
            row.update(
                _summary(measure_saved(model, batch, partitioner="min_cut", enable_ac=False))
            )
    return row


def _cache_counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        "fxgraph_hit": int(counters["inductor"]["fxgraph_cache_hit"]),
        "fxgraph_miss": int(counters["inductor"]["fxgraph_cache_miss"]),
        "aot_hit": int(counters["aot_autograd"]["autograd_cache_hit"]),
        "aot_miss": int(counters["aot_autograd"]["autograd_cache_miss"]),
    }


def _worker_environment(device: str) -> dict[str, Any]:
    if device == "cuda":
        card = torch.cuda.get_device_name()
    else:
        card = platform.processor() or platform.machine() or "cpu"
    return {
        "card": card,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One row in this process (``--worker SPEC``): ``spec`` has ``key``, ``phase`` (``cold``
    measures everything, ``warm`` only the first step), ``shape``, ``settings`` and
    ``budget_bytes``."""
    settings = Settings(**spec["settings"])
    cfg = ModelConfig(**spec["shape"])
    out: dict[str, Any] = {
        "pid": os.getpid(),
        "phase": spec["phase"],
        "inductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"),
        "environment": _worker_environment(settings.device),
        "started_s": time.time() - _T0,  # imports
    }
    device = torch.device(settings.device)
    with fake_world(WORLD):
        start = time.perf_counter()
        model = Transformer(cfg, Sharding.from_world(gather_dtype=torch.bfloat16)).to(device)
        tokens, targets = model.example_batch(0, 0)
        batch = (tokens.to(device), targets.to(device))
        _sync(settings.device)
        out["setup_s"] = time.perf_counter() - start
        out.update(
            measure_row(
                spec["key"],
                model,
                batch,
                settings,
                spec.get("budget_bytes"),
                compile_only=spec["phase"] == "warm",
            )
        )
    out["cache"] = _cache_counters()
    return out


# ---------------------------------------------------------------------------------------------
# the runner: one worker process per row, round and phase


@dataclass
class Job:
    key: str
    round: int
    phase: str  # "cold" or "warm"
    cache: Path
    result: dict[str, Any] = field(default_factory=dict)


def _pycache_dir() -> str | None:
    """A bytecode directory the workers share where this python writes none (see the module
    docstring)."""
    if not os.environ.get("PYTHONDONTWRITEBYTECODE") or os.environ.get("PYTHONPYCACHEPREFIX"):
        return None
    uid = os.getuid() if hasattr(os, "getuid") else 0
    path = Path(tempfile.gettempdir()) / f"ap-benchmarks-pycache-{uid}"
    path.mkdir(exist_ok=True)
    return str(path)


def _worker_env(cache: Path, compile_threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
    env["TRITON_CACHE_DIR"] = str(cache / "triton")
    env["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "1"
    env["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    if compile_threads is not None:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(compile_threads)
    pycache = _pycache_dir()
    if pycache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = pycache
    return env


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a worker and what it started (its compile workers): its own process group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _spawn(job: Job, plan: Plan, budget_bytes: int | None, timeout: float | None) -> dict[str, Any]:
    job.cache.mkdir(parents=True, exist_ok=True)
    stem = job.cache / f"{job.phase}"
    spec = {
        "key": job.key,
        "phase": job.phase,
        "shape": asdict(plan.shape),
        "settings": asdict(plan.settings),
        "budget_bytes": budget_bytes,
    }
    spec_path = stem.with_suffix(".spec.json")
    out_path = stem.with_suffix(".out.json")
    log_path = stem.with_suffix(".log")
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "benchmarks.gpu", "--worker", str(spec_path), str(out_path)]
    start = time.perf_counter()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=_worker_env(job.cache, plan.compile_threads),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, for _stop
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            wall = time.perf_counter() - start
            return {
                "status": f"stopped: budget (still running after {wall:.0f} s at the deadline)",
                "wall_s": wall,
                "pid": proc.pid,
            }
        finally:
            if proc.poll() is None:  # KeyboardInterrupt and the like
                _stop(proc)
    wall = time.perf_counter() - start
    if rc != 0 or not out_path.is_file():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-8:]
        return {"status": f"failed (exit {rc})", "wall_s": wall, "log_tail": tail}
    result: dict[str, Any] = json.loads(out_path.read_text())
    result.update(status="ok", wall_s=wall)
    return result


def _estimate(job: Job, done: list[Job], cold_of: dict[tuple[str, int], Job]) -> float | None:
    """Seconds ``job`` should take, from the workers that ran (``None``: nothing to go by).

    A cold worker is its process overhead (wall minus first step: imports, model, timed steps,
    profiler, ``measure_saved``) plus its first step, which scales with :data:`COST`; a warm
    worker is its cold run times the warm/cold ratio seen so far (:data:`WARM_GUESS` before
    the first)."""
    ok = [j for j in done if j.result.get("status") == "ok"]
    same = [j.result["wall_s"] for j in ok if j.key == job.key and j.phase == job.phase]
    if same:
        return float(max(same))
    if job.phase == "cold":
        cold = [j for j in ok if j.phase == "cold"]
        if not cold:
            return None
        overhead = statistics.median(j.result["wall_s"] - j.result["compile_s"] for j in cold)
        unit = statistics.median(j.result["compile_s"] / COST.get(j.key, 2.0) for j in cold)
        return float(overhead + unit * COST.get(job.key, 2.0))
    base = cold_of[(job.key, job.round)].result["wall_s"]
    ratios = [
        j.result["wall_s"] / cold_of[(j.key, j.round)].result["wall_s"]
        for j in ok
        if j.phase == "warm"
    ]
    return float(base * (statistics.median(ratios) if ratios else WARM_GUESS))


def _environment(device: str) -> dict[str, Any]:
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": device,
        "card": None,  # from the first worker (the runner never initialises CUDA)
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cores": os.cpu_count(),
        "runner_pid": os.getpid(),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def _assemble(
    plan: Plan, env: dict[str, Any], jobs: list[Job], started: float, deadline: float | None
) -> dict[str, Any]:
    """The JSON of a run so far: per row its first good cold run's numbers at top level (the
    table's cells), ``status``, and every cold (``runs``) and warm (``warm_runs``) worker."""
    rows: dict[str, Any] = {}
    labels = dict(ROWS)
    for key in plan.rows:
        cold = [j for j in jobs if j.key == key and j.phase == "cold" and j.result]
        warm = [j for j in jobs if j.key == key and j.phase == "warm" and j.result]
        row: dict[str, Any] = {"key": key, "label": labels[key]}
        good = [j for j in cold if j.result.get("status") == "ok"]
        if good:
            row.update({k: v for k, v in good[0].result.items() if k != "environment"})
        row["status"] = (
            good[0].result["status"] if good else (cold[0].result["status"] if cold else "pending")
        )
        row["runs"] = [
            dict(j.result, round=j.round, phase=j.phase, cache_dir=str(j.cache)) for j in cold
        ]
        row["warm_runs"] = [
            dict(j.result, round=j.round, phase=j.phase, cache_dir=str(j.cache)) for j in warm
        ]
        for r in (*row["runs"], *row["warm_runs"]):
            r.pop("environment", None)
        rows[key] = row
    statuses = [j.result.get("status", "") for j in jobs if j.result]
    return {
        "environment": env,
        "world": WORLD,
        "steps": plan.settings.steps,
        "settings": asdict(plan.settings),
        "rounds": plan.rounds,
        "warm": plan.warm,
        "budget_s": plan.budget_s,
        "deadline_left_s": None if deadline is None else round(deadline - time.time(), 1),
        "wall_s": round(time.time() - started, 1),
        "workers": {
            "ok": sum(s == "ok" for s in statuses),
            "not_run": sum(s.startswith(("not run", "stopped")) for s in statuses),
            "failed": sum(s.startswith("failed") for s in statuses),
        },
        "shapes": [{"shape": asdict(plan.shape), "rows": rows}],
    }


def execute(
    plan: Plan,
    deadline: float | None = None,
    json_path: Path | None = None,
    started: float | None = None,
) -> dict[str, Any]:
    """Every row of ``plan`` in fresh worker processes, cold rounds first, then the warm runs,
    within ``deadline`` (``time.time()``; default ``started`` + ``plan.budget_s``)."""
    started = time.time() if started is None else started
    if deadline is None and plan.budget_s is not None:
        deadline = started + plan.budget_s
    env = _environment(plan.settings.device)
    env["budget_s"] = None if deadline is None else round(deadline - started, 1)
    root = Path(tempfile.mkdtemp(prefix="ap-gpu-bench-"))
    env["cache_root"] = str(root)
    jobs: list[Job] = []
    for r in range(plan.rounds):
        order = plan.rows if r % 2 == 0 else tuple(reversed(plan.rows))
        jobs += [Job(key, r, "cold", root / f"r{r + 1}-{key}") for key in order]
    if plan.warm:
        jobs += [Job(j.key, j.round, "warm", j.cache) for j in list(jobs)]
    cold_of = {(j.key, j.round): j for j in jobs if j.phase == "cold"}
    done: list[Job] = []
    try:
        for n, job in enumerate(jobs, start=1):
            tag = f"[{n}/{len(jobs)}] {job.key} ({job.phase}, round {job.round + 1})"
            if job.phase == "warm" and cold_of[(job.key, job.round)].result.get("status") != "ok":
                job.result = {"status": "not run: no cold run to re-run"}
            else:
                left = None if deadline is None else deadline - time.time() - RESERVE_S
                need = _estimate(job, done, cold_of)
                if left is not None and (left <= 0 or (need is not None and need > left)):
                    want = "" if need is None else f"needs ~{need:.0f} s, "
                    job.result = {"status": f"not run: budget ({want}{max(left, 0):.0f} s left)"}
                else:
                    budget_bytes = None
                    if job.key == "ap_budget":
                        default = [
                            j.result["saved_bytes"]
                            for j in done
                            if j.key == "ap_default" and "saved_bytes" in j.result
                        ]
                        budget_bytes = default[0] // 2 if default else None
                    print(f"benchmarks.gpu: {tag} ...", file=sys.stderr, flush=True)
                    job.result = _spawn(job, plan, budget_bytes, left)
                    done.append(job)
                    if env["card"] is None and "environment" in job.result:
                        env.update(job.result["environment"])
            print(f"benchmarks.gpu: {tag}: {_job_line(job)}", file=sys.stderr, flush=True)
            if json_path is not None:
                _write(json_path, _assemble(plan, env, jobs, started, deadline))
    finally:
        env["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
        shutil.rmtree(root, ignore_errors=True)
    result = _assemble(plan, env, jobs, started, deadline)
    if json_path is not None:
        _write(json_path, result)
    return result


def _write(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(path)


def _job_line(job: Job) -> str:
    r = job.result
    if r.get("status") != "ok":
        tail = " | ".join(r.get("log_tail", [])[-3:])
        return str(r.get("status", "?")) + (f": {tail}" if tail else "")
    head = f"{r['wall_s']:.1f} s wall (pid {r['pid']}), first step {r['compile_s']:.1f} s"
    if job.phase == "warm":
        return f"{head}, caches {r['cache']}"
    peak = r["peak_bytes"]
    return (
        f"{head}, step {r['step_ms']:.1f} ms"
        + ("" if peak is None else f", peak {peak / 2**30:.2f} GiB")
        + f", saved {r['saved_bytes']:,} B ({r['saved_ag']} all-gather outputs), "
        f"{r['kernels_per_step']:.0f} kernels / step"
    )


def run(
    quick: bool = False,
    device: str = "cpu",
    rows: Sequence[str] | None = None,
    shapes: Sequence[ModelConfig] | None = None,
    steps: int | None = None,
) -> dict[str, Any]:
    """The suite's entry (``python -m benchmarks``): :func:`execute` with the defaults of
    ``device`` / ``quick``. Raises if a row failed (a budget skip is no failure)."""
    shape = shapes[0] if shapes else None
    result = execute(plan_for(device, quick, rows, shape, steps))
    failed = [k for k, r in result["shapes"][0]["rows"].items() if r["status"].startswith("fail")]
    if failed:
        raise RuntimeError(f"benchmarks.gpu: rows failed: {failed}")
    return result


# ---------------------------------------------------------------------------------------------
# the table


def _bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:,} B"


def _slash(values: Sequence[float], fmt: str = "{:.1f}") -> str:
    return " / ".join(fmt.format(v) for v in values)


_COLUMNS = (
    ("row", "l"),
    ("step ms (median)", "r"),
    ("peak GiB", "r"),
    ("saved for backward", "l"),
    ("kernels / step", "r"),
    ("kernel ms", "r"),
    ("GFLOP / step", "r"),
    ("generated kernels", "r"),
    ("first step s (cold)", "r"),
    ("warm first step s", "r"),
)


def _gflops_cell(first: dict[str, Any], plain: dict[str, Any] | None) -> str:
    """A row's GFLOPs per step and, beside plain's, the ratio (recomputation shows here)."""
    gflops = first.get("gflops_per_step")
    if gflops is None:  # a record from before the column
        return "-"
    cell = f"{gflops:,.1f}" if gflops >= 100 else f"{gflops:.3g}"
    base = None if plain is None else plain.get("gflops_per_step")
    if base and first is not plain:
        cell += f" ({gflops / base:.2f}x)"
    return cell


def _row_cells(key: str, row: dict[str, Any], plain: dict[str, Any] | None) -> list[object]:
    ok = [r for r in row["runs"] if r.get("status") == "ok"]
    if not ok:
        return [row["label"], row["status"], "", "", "", "", "", "", "", ""]
    first = ok[0]
    step = [r["step_ms"] for r in ok]
    step_cell = f"{statistics.median(step):.1f}"
    if len(ok) > 1:
        step_cell += f" ({_slash(step)})"
    else:
        step_cell += f" ({first['step_min_ms']:.1f}-{first['step_max_ms']:.1f})"
    peak = first["peak_bytes"]
    saved = f"{_bytes(first['saved_bytes'])} ({first['saved_ag']} all-gather outputs)"
    if plain is not None and key != "plain" and plain.get("saved_bytes"):
        saved += f", {first['saved_bytes'] / plain['saved_bytes']:.2f}x plain"
    if "budget_bytes" in first:
        saved += f"; budget {_bytes(first['budget_bytes'])}"
    compile_cell = _slash([r["compile_s"] for r in ok])
    if not key.startswith("plain"):
        compile_cell += f" (precompile {_slash([r['precompile_s'] for r in ok])})"
    warm_ok = [r for r in row["warm_runs"] if r.get("status") == "ok"]
    if warm_ok:
        warm_cell = _slash([r["compile_s"] for r in warm_ok])
    elif row["warm_runs"]:
        warm_cell = row["warm_runs"][0]["status"]
    else:
        warm_cell = "-"
    return [
        row["label"],
        step_cell,
        "n/a" if peak is None else f"{peak / 2**30:.2f}",
        saved,
        f"{statistics.median(r['kernels_per_step'] for r in ok):,.0f}",
        f"{statistics.median(r['kernel_ms'] for r in ok):.1f}",
        _gflops_cell(first, plain),
        first["generated_kernels"],
        compile_cell,
        warm_cell,
    ]


def _process_table(rows: dict[str, Any]) -> str:
    cells = []
    for key, row in rows.items():
        for r in (*row["runs"], *row["warm_runs"]):
            hits = r.get("cache")
            cache_cell = (
                "-"
                if hits is None
                else f"{hits['fxgraph_hit']}/{hits['fxgraph_miss']}, "
                f"{hits['aot_hit']}/{hits['aot_miss']}"
            )
            wall = r.get("wall_s")
            cells.append(
                [
                    key,
                    r["round"] + 1,
                    r["phase"],
                    r.get("pid", "-"),
                    "-" if wall is None else f"{wall:.1f}",
                    Path(r["cache_dir"]).name,
                    cache_cell,
                    r["status"],
                ]
            )
    return markdown_table(
        (
            ("row", "l"),
            ("round", "r"),
            ("run", "l"),
            ("pid", "r"),
            ("wall s", "r"),
            ("cache dir", "l"),
            ("FX-graph hit/miss, AOTAutograd hit/miss", "l"),
            ("status", "l"),
        ),
        cells,
    )


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    cuda = env["device"] == "cuda"
    st = result["settings"]
    shape = result["shapes"][0]
    s = shape["shape"]
    budget = env.get("budget_s", result["budget_s"])
    workers = result["workers"]
    parts = [
        f"**{env.get('card') or env['device']}** ({env['device']}), torch {env['torch']}"
        + (f" (CUDA {env['cuda']})" if cuda and env.get("cuda") else "")
        + f", Python {env['python']}, {env['date']}; load average {env['load_avg_at_start']}"
        f" at start, {env.get('load_avg_at_end')} at end.",
        f"Model kit dim {s['dim']}, {s['n_layers']} layers, {s['n_heads']} heads, ffn "
        f"{s['ffn_dim']}, vocab {s['vocab']}, seq {s['seq_len']}, batch {s['batch']} "
        f"({s['seq_len'] * s['batch']:,} tokens per rank), attention {s['attention']}; fake PG "
        f"world {result['world']}, bf16 gathers. Step: median of {st['steps']} steady steps "
        f"after {st['warmup']} warm-up; kernels over {st['profile_steps']} profiled step(s), "
        "per step: "
        + (
            "device events (torch.profiler)."
            if cuda
            else "C++ kernels + top-level aten ops and their CPU time (torch.profiler; a CPU "
            "analogue). Peak memory: n/a on CPU."
        ),
        f"Each row a fresh process with its own Inductor and Triton cache dirs (caches on, "
        f"empty for the cold column); {result['rounds']} round(s), warm column "
        f"{'on' if result['warm'] else 'off'}; budget "
        + ("none" if budget is None else f"{budget:.0f} s from the runner's start")
        + f", wall {result['wall_s']:.0f} s; workers: {workers['ok']} ok, "
        f"{workers['not_run']} not run (budget), {workers['failed']} failed.",
    ]
    plain = shape["rows"].get("plain")
    plain_first = None
    if plain is not None:
        ok = [r for r in plain["runs"] if r.get("status") == "ok"]
        plain_first = ok[0] if ok else None
    table = [_row_cells(key, row, plain_first) for key, row in shape["rows"].items()]
    parts.append(markdown_table(_COLUMNS, table))
    parts.append("Workers:\n\n" + _process_table(shape["rows"]))
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------------------------
# command line


def _shape_arg(base: ModelConfig, args: argparse.Namespace) -> ModelConfig:
    changes = {
        name: value
        for name, value in (
            ("dim", args.dim),
            ("n_layers", args.layers),
            ("n_heads", args.heads),
            ("ffn_dim", args.ffn),
            ("seq_len", args.seq),
            ("batch", args.batch),
        )
        if value is not None
    }
    return base.with_(**changes) if changes else base


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:  # python -m benchmarks.gpu --worker SPEC OUT
        spec_path, out_path = argv[1:3]
        result = worker(json.loads(Path(spec_path).read_text()))
        Path(out_path).write_text(json.dumps(result))
        return 0
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="the small shape and rows")
    parser.add_argument("--json", type=Path, help="also write the numbers here (after each row)")
    parser.add_argument("--rows", help="comma-separated keys (default: see above)")
    parser.add_argument("--steps", type=int, help="steady steps to time")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (default 1)")
    parser.add_argument(
        "--warm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="re-run each row on its filled caches (default: on, off with --quick)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=-1.0,
        help="seconds from start; rows that would not fit are not run (default: 450 on "
        "CUDA, 90 with --quick, none on CPU; 0: none)",
    )
    parser.add_argument("--deadline", type=float, help="absolute deadline, time.time()")
    parser.add_argument(
        "--compile-threads", type=int, help="TORCHINDUCTOR_COMPILE_THREADS of the workers"
    )
    for name in ("dim", "layers", "heads", "ffn", "seq", "batch"):
        parser.add_argument(f"--{name}", type=int, help=f"override the shape's {name}")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device (use --device cpu)")
    rows = tuple(args.rows.split(",")) if args.rows else None
    unknown = set(rows or ()) - {k for k, _ in ROWS}
    if unknown:
        parser.error(f"--rows: unknown {sorted(unknown)}")
    budget = None if args.budget_s == 0 else args.budget_s
    plan = plan_for(
        args.device,
        args.quick,
        rows,
        None,
        args.steps,
        args.rounds,
        args.warm,
        budget,
        args.compile_threads,
    )
    plan = replace(plan, shape=_shape_arg(plan.shape, args))
    deadline = args.deadline
    if deadline is None and plan.budget_s is not None:
        deadline = _T0 + plan.budget_s
    result = execute(plan, deadline, args.json, started=_T0)
    print(markdown(result))
    if args.json is not None:
        print(f"json: {args.json}")
    return 1 if result["workers"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
