"""Section 6: the zoo's torchtitan Llama3 and Qwen3-MoE at 2 and 4 layers, 2,048 tokens per rank.

Sized so activations dominate (issue 35): sequence 1024, batch 2 (2,048 tokens per rank), few
layers and a small width so the run still takes minutes on a 2-core CPU.

Activation memory saved for backward, measured two ways on the same partitions:

* **graph**: ap-tags' one definition of "saved" (``ap_tags.graph.activation_storages`` of the
  forward's saved outputs), as ``PartitionReport`` and ``precompile``'s ``first_partition``
  report it: distinct storages, graph inputs excluded, bytes from the graphs' sizes;
* **run time**: the forward is *executed* (AOTAutograd with identity compilers, so the graphs
  run as partitioned) and the tensors autograd actually holds for the backward are read off the
  loss's autograd graph (``grad_fn.saved_tensors`` of every node), counted once per storage,
  excluding the parameters', buffers' and batch's storages (the caller holds those anyway).

Partitions, each without and with AC (ap-tags' AC joint pass; for the replays it runs in the
first compilation too, ``precompile(..., joint_pass=ap_tags.ac_joint_pass())``): (a) the first
compilation's own (``precompile``'s default, min-cut on the tagged joint, AC off); plain
``torch.compile`` (min-cut on the untagged model: what stock Inductor keeps); tagged min-cut
(min-cut on ``precompile``'s output); the ap replay (SaveAll) of the min-cut first partition
(``first_partition="min_cut"``, the default) and of the ``default_partition`` one
(``first_partition="default"``). Every model is the zoo's
``FsdpTrainStep`` on the fake process group (world size 8): real graphs, garbage data, so only
bytes are meaningful.

Compile and step time of the real backend against stock Inductor are measured by
:mod:`benchmarks.real_models_compile` (a subprocess per compile, fresh cache directory each).

    uv run python -m benchmarks.real_models [--quick]
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import ap_tags
import torch
from ap_backend import PrecompiledModule, precompile
from ap_partitioner import MinCutPartitioner, PartitionReport, SaveAllPartitioner, wait_tensor_dce
from ap_testing.distributed import fake_world
from torch import nn

from benchmarks import markdown_table

#: (zoo builder name, width) of each model; layer counts per run mode below.
MODELS: dict[str, dict[str, int]] = {
    "tt_llama3": {"dim": 256, "seq": 1024},
    "tt_qwen3_moe": {"dim": 128, "seq": 1024},
}
LAYERS_FULL = (2, 4)
LAYERS_QUICK = (1,)
QUICK_MODELS = ("tt_llama3",)
QUICK_WIDTH = {"dim": 64, "seq": 16}

#: (key, label, partitioner, AC on, which module: ``None`` the untagged step, else the
#: ``first_partition`` of the ``precompile`` whose output is partitioned)
FirstPartitioner = Literal["min_cut", "default"]
_ROWS: tuple[tuple[str, str, Any, FirstPartitioner | None], ...] = (
    ("plain", "plain torch.compile", MinCutPartitioner, None),
    ("tagged_min_cut", "tagged min-cut", MinCutPartitioner, "min_cut"),
    ("replay_min_cut", "ap replay of the min-cut first", SaveAllPartitioner, "min_cut"),
    ("replay_default", "ap replay of default_partition first", SaveAllPartitioner, "default"),
)
PARTITIONS: tuple[tuple[str, str, Any, bool, FirstPartitioner | None], ...] = tuple(
    (key + suffix, label + ac_label, cls, ac, first)
    for ac, suffix, ac_label in ((False, "", ""), (True, "_ac", " + AC"))
    for key, label, cls, first in _ROWS
)


def build_step(
    name: str, size: dict[str, int], *, dtype: torch.dtype | None = None
) -> tuple[nn.Module, tuple[Any, ...]]:
    """The zoo model ``name`` built at ``size`` (``n_layers``, ``dim``, ``seq``, ...), cast to
    ``dtype`` when given, wrapped in the zoo's FSDP-style ``FsdpTrainStep`` on the current (fake)
    process group; and its first batch."""
    from zoo.fsdp import FsdpTrainStep
    from zoo.models import torchtitan_models

    builder: dict[str, Callable[..., Any]] = {
        "tt_llama3": torchtitan_models.llama3,
        "tt_qwen3_moe": torchtitan_models.qwen3_moe,
        "tt_llama3_8b": torchtitan_models.llama3_8b,
    }
    zm = builder[name](1, **size)
    if dtype is not None:  # parameters only (FSDP's parameter dtype); buffers such as the
        for param in zm.module.parameters():  # complex RoPE table keep theirs
            param.data = param.data.to(dtype)
    step = FsdpTrainStep(zm.module, zm.loss_fn, n_model_inputs=zm.n_model_inputs)
    return step, tuple(zm.batches[0])


def _identity(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    def run(args: list[Any]) -> Any:
        return gm(*args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


@contextlib.contextmanager
def _partitioning(partitioner: Any, ac: bool, ap: bool) -> Iterator[None]:
    """Inductor's joint passes and ``partitioner`` as the backend runs them (with ap-partitioner's
    ``wait_tensor_dce`` for ap configurations; without it for plain ``torch.compile``)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    joint_pass = ap_tags.ac_joint_pass("auto") if ac else None
    with contextlib.ExitStack() as stack:
        if ap:
            stack.enter_context(wait_tensor_dce())
        stack.enter_context(functorch_config.patch(joint_custom_pass=joint_pass))
        stack.enter_context(inductor_config.patch(custom_partitioner_fn=partitioner))
        yield


def _compiled_identity(module: nn.Module, partitioner: Any, ac: bool, ap: bool) -> Any:
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.compile_fx import partition_fn

    backend = aot_autograd(fw_compiler=_identity, bw_compiler=_identity, partition_fn=partition_fn)
    compiled = torch.compile(module, backend=backend)

    def call(*args: Any) -> torch.Tensor:
        with _partitioning(partitioner, ac, ap):
            out: torch.Tensor = compiled(*args)
        return out

    return call


@dataclass
class RuntimeSaved:
    """Storages autograd holds for the backward after one forward, read off the graph."""

    count: int
    nbytes: int


def runtime_saved(loss: torch.Tensor, held: Sequence[torch.Tensor]) -> RuntimeSaved:
    """Walk ``loss``'s autograd graph; every node's ``saved_tensors`` (custom functions, hence
    AOTAutograd's compiled function) and ``_saved_*`` tensors (eager nodes), once per storage,
    excluding the storages of ``held`` (parameters, buffers, inputs)."""
    skip = {t.untyped_storage().data_ptr() for t in held}
    storages: dict[int, int] = {}
    stack, seen = [loss.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        tensors: list[Any] = []
        with contextlib.suppress(RuntimeError, AttributeError):
            tensors.extend(getattr(fn, "saved_tensors"))  # noqa: B009 (not on every node type)
        for attr in dir(fn):
            if attr.startswith("_saved_") and not attr.endswith("_raw"):
                with contextlib.suppress(RuntimeError):
                    tensors.append(getattr(fn, attr))
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if storage.data_ptr() not in skip:
                    storages[storage.data_ptr()] = storage.nbytes()
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return RuntimeSaved(len(storages), sum(storages.values()))


def _held(step: nn.Module, batch: Sequence[Any]) -> list[torch.Tensor]:
    return [*step.parameters(), *step.buffers(), *(t for t in batch if isinstance(t, torch.Tensor))]


def _row(report: PartitionReport | None, rt: RuntimeSaved, seconds: float) -> dict[str, Any]:
    row: dict[str, Any] = {"runtime_count": rt.count, "runtime_bytes": rt.nbytes, "s": seconds}
    if report is not None:
        row.update(
            count=report.saved_activation_count,
            bytes=report.saved_activation_bytes,
            all_gather_count=report.saved_all_gather_count,
            all_gather_bytes=report.saved_all_gather_bytes,
            backward_all_gathers=report.backward_all_gathers,
            fell_back=report.fell_back,
        )
    return row


def measure(name: str, n_layers: int, width: dict[str, int]) -> dict[str, Any]:
    """Every partition of one model size, graph and run-time measures side by side."""
    torch.compiler.reset()
    step, batch = build_step(name, {"n_layers": n_layers, **width})
    n_params = sum(s.numel() * 8 for s in step.parameters())  # fake world size 8
    rows = measure_step(step, batch, PARTITIONS)
    return {"model": name, "layers": n_layers, **width, "params": n_params, "partitions": rows}


def measure_step(
    step: nn.Module, batch: tuple[Any, ...], partitions: Sequence[tuple[Any, ...]]
) -> dict[str, Any]:
    """The first partition (``precompile``) and every one of ``partitions`` (see
    :data:`PARTITIONS`) of ``step`` on ``batch``: graph and run-time measures per key."""
    held = _held(step, batch)
    precompiled: dict[tuple[FirstPartitioner, bool], PrecompiledModule] = {}

    def first_compilation(first: FirstPartitioner, ac: bool) -> PrecompiledModule:
        if (first, ac) not in precompiled:
            torch.compiler.reset()
            joint_pass = ap_tags.ac_joint_pass() if ac else None
            precompiled[first, ac] = precompile(
                step, batch, joint_pass=joint_pass, first_partition=first
            )
        return precompiled[first, ac]

    start = time.perf_counter()
    pm = first_compilation("min_cut", False)
    first_s = time.perf_counter() - start
    loss = pm(*batch)
    first_rt = runtime_saved(loss, held)
    loss.backward()
    first = pm.first_partition
    row: dict[str, Any] = {"runtime_count": first_rt.count, "runtime_bytes": first_rt.nbytes}
    row.update(s=first_s, count=first.count, bytes=first.nbytes)
    # SavedSummary names the all-gather outputs it saved; their bytes come from PartitionReport
    row.update(all_gather_count=len(first.all_gather_outputs), all_gather_bytes=None)
    rows: dict[str, Any] = {"first": row}
    for key, _, cls, ac, first in partitions:
        module = step if first is None else first_compilation(first, ac)
        torch.compiler.reset()
        reports: list[PartitionReport] = []
        call = _compiled_identity(module, cls(on_report=reports.append), ac, first is not None)
        start = time.perf_counter()
        loss = call(*batch)
        seconds = time.perf_counter() - start
        rt = runtime_saved(loss, held)
        loss.backward()
        step.zero_grad(set_to_none=True)
        rows[key] = _row(reports[-1] if reports else None, rt, seconds)
    return rows


def run(quick: bool) -> dict[str, Any]:
    results = []
    with fake_world():
        for name, width in MODELS.items():
            if quick and name not in QUICK_MODELS:
                continue
            for n in LAYERS_QUICK if quick else LAYERS_FULL:
                results.append(measure(name, n, QUICK_WIDTH if quick else width))
    return {"rows": results}


_COLUMNS = (
    ("model", "l"),
    ("layers", "r"),
    ("partition", "l"),
    ("saved tensors (graph)", "r"),
    ("saved bytes (graph)", "r"),
    ("saved tensors (run time)", "r"),
    ("saved bytes (run time)", "r"),
    ("all-gather outputs saved", "r"),
    ("all-gather bytes saved", "r"),
    ("bw all-gathers", "r"),
)


def _mb(n: int | None) -> str:
    return "–" if n is None else f"{n / 2**20:,.2f} MiB"


def markdown(result: dict[str, Any]) -> str:
    labels = (("first", "(a) first partition"), *((k, lbl) for k, lbl, *_ in PARTITIONS))
    rows: list[list[object]] = []
    for r in result["rows"]:
        for key, label in labels:
            p = r["partitions"][key]
            ag_bytes = p.get("all_gather_bytes")
            if ag_bytes is None and p.get("all_gather_count") == 0:
                ag_bytes = 0
            rows.append(
                [
                    f"{r['model']} (dim {r['dim']}, seq {r['seq']})",
                    r["layers"],
                    label + (" (fell back)" if p.get("fell_back") else ""),
                    p["count"],
                    _mb(p["bytes"]),
                    p["runtime_count"],
                    _mb(p["runtime_bytes"]),
                    p["all_gather_count"],
                    _mb(ag_bytes),
                    p.get("backward_all_gathers", "–"),
                ]
            )
    return markdown_table(_COLUMNS, rows)


if __name__ == "__main__":
    print(markdown(run(quick="--quick" in sys.argv)))
