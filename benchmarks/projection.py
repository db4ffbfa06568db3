"""Section 8: saved bytes per rank of LLaMA-3 8B, FSDP on 128 ranks, bf16, exact partitions on
meta tensors (issue 35, item 3).

No hand arithmetic and no execution: torchtitan's own 8B config (dim 4096, 32 q / 8 kv heads,
FFN 14336, fused QKV, its real vocabulary of 128,256 tokens) is built on the ``meta`` device
with its first 1, 2 and 3 transformer layers, its parameters cast to bf16 (FSDP's bf16
parameter all-gather), wrapped in the zoo's ``FsdpTrainStep`` on a fake process group of world
size 128, and given one meta batch of sequence 8192, batch 1 per rank. Every partition is the
real one, on the real graphs (Dynamo + AOTAutograd; ``precompile`` traces on fake tensors;
the identity compilers "run" the partitioned graphs on meta tensors, which allocates nothing),
measured by one definition of "saved" (``ap_backend.SavedSummary``: distinct storages the
forward saves for the backward, graph inputs excluded -- all of it, not only the all-gather
outputs):

* plain ``torch.compile``: ``measure_saved(step, partitioner="min_cut")`` on the untagged step
  (AC: with ap-tags' AC joint pass);
* tagged min-cut: ``measure_saved(precompile(step), partitioner="min_cut")``;
* replay: ``measure_saved(pm, partitioner="save_all")`` of ``pm = precompile(step,
  first_partition="min_cut" | "default")`` (AC: ``precompile(..., joint_pass=
  ap_tags.ac_joint_pass())`` and the AC pass in the replay too); the first partition's own
  bytes (``pm.first_partition``) are recorded beside it.

Per layer = the 2-layer minus the 1-layer figure; linearity is checked against the 3-layer one
(3 - 2 must equal 2 - 1). 32 layers = the 1-layer figure + 31 x per layer (embedding, head and
the fp32 loss over 128,256 logits included once).

    uv run python -m benchmarks.projection
"""

from __future__ import annotations

import os

if __name__ == "__main__":
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
    os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import ap_tags
import torch
from ap_backend import SavedSummary, measure_saved, precompile
from ap_testing.distributed import fake_world
from torch import nn

from benchmarks import markdown_table

WORLD = 128
SEQ = 8192
BATCH = 1
VOCAB = 128256
LAYERS = (1, 2, 3)
FULL_LAYERS = 32

#: (key, label) of every measured partition, in table order.
PARTITIONS: tuple[tuple[str, str], ...] = (
    ("plain", "plain `torch.compile` (min-cut, untagged)"),
    ("tagged_min_cut", "tagged min-cut (on `precompile`'s graph)"),
    ("first_min_cut", 'first partition, `first_partition="min_cut"` (default)'),
    ("replay_min_cut", "ap replay of the min-cut first partition"),
    ("first_default", 'first partition, `first_partition="default"`'),
    ("replay_default", "ap replay of the default_partition first partition"),
)


def build_8b_step(
    n_layers: int, *, seq: int = SEQ, batch: int = BATCH, vocab: int = VOCAB
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """torchtitan's 8B config cut to ``n_layers`` layers, built on meta, in the zoo's
    ``FsdpTrainStep`` on the current (fake) process group, with its bf16 parameter shards and
    buffers made real zero CPU tensors (a 1/128 shard of an 8B layer is 1.7 M parameters: the
    full model itself stays on meta, the step only reads its structure); and a zero batch."""
    from zoo.fsdp import FsdpTrainStep
    from zoo.models import torchtitan_models

    with torch.device("meta"):
        zm = torchtitan_models.llama3_8b(0, n_layers=n_layers, seq=seq, vocab=vocab)
        step = FsdpTrainStep(zm.module, zm.loss_fn, n_model_inputs=zm.n_model_inputs)
    _materialize(step, torch.zeros)
    tokens = torch.zeros(batch, seq, dtype=torch.long)
    return step, (tokens, torch.zeros(batch, seq, dtype=torch.long))


def _materialize(module: nn.Module, make: Callable[..., torch.Tensor]) -> None:
    """Replace every parameter (as bf16) and buffer of ``module`` by ``make(shape, dtype=...)``
    (real zeros for ``precompile``; ``torch.empty`` under a ``FakeTensorMode`` for the
    measures, whose identity compilers then run the partitioned graphs on fake tensors)."""
    for name, param in list(module.named_parameters()):
        owner, _, attr = name.rpartition(".")
        new = make(param.shape, dtype=torch.bfloat16)
        setattr(module.get_submodule(owner), attr, nn.Parameter(new, param.requires_grad))
    for name, buf in list(module.named_buffers()):
        owner, _, attr = name.rpartition(".")
        module.get_submodule(owner).register_buffer(attr, make(buf.shape, dtype=buf.dtype))


@contextlib.contextmanager
def _fake(step: nn.Module, batch: tuple[torch.Tensor, ...]) -> Iterator[tuple[torch.Tensor, ...]]:
    """``step``'s parameters and buffers as fake tensors for the block, and a fake batch; real
    zeros again afterwards (``precompile`` traces real modules with a fake mode of its own)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        _materialize(step, torch.empty)
        fake_batch = tuple(torch.empty(t.shape, dtype=t.dtype) for t in batch)
    try:
        yield fake_batch
    finally:
        _materialize(step, torch.zeros)


def _entry(summary: SavedSummary, seconds: float) -> dict[str, Any]:
    return {
        "bytes": summary.nbytes,
        "count": summary.count,
        "all_gather_count": len(summary.all_gather_outputs),
        "s": round(seconds, 2),
    }


def _timed(
    module: nn.Module, step: nn.Module, batch: tuple[torch.Tensor, ...], partitioner: str, ac: bool
) -> dict[str, Any]:
    """``measure_saved(module, ...)`` on fake parameters (of ``step``) and a fake batch."""
    torch.compiler.reset()
    start = time.perf_counter()
    with _fake(step, batch) as fake_batch:
        summary = measure_saved(module, fake_batch, partitioner=partitioner, enable_ac=ac)
    return _entry(summary, time.perf_counter() - start)


def measure(n_layers: int, *, seq: int = SEQ, vocab: int = VOCAB) -> dict[str, Any]:
    """Every partition of :data:`PARTITIONS`, AC off and on, at ``n_layers`` layers."""
    step, batch = build_8b_step(n_layers, seq=seq, vocab=vocab)
    model: nn.Module = step.model  # type: ignore[assignment]  # FsdpTrainStep's full model
    out: dict[str, Any] = {
        "layers": n_layers,
        "full_params": sum(p.numel() for p in model.parameters()),  # meta: shapes only
    }
    for ac in (False, True):
        row: dict[str, Any] = {}
        joint_pass = ap_tags.ac_joint_pass() if ac else None
        row["plain"] = _timed(step, step, batch, "min_cut", ac)
        for first in ("min_cut", "default"):
            torch.compiler.reset()
            start = time.perf_counter()
            pm = precompile(step, batch, joint_pass=joint_pass, first_partition=first)
            row[f"first_{first}"] = _entry(pm.first_partition, time.perf_counter() - start)
            row[f"first_{first}"]["partitioner"] = pm.first_partitioner
            row[f"replay_{first}"] = _timed(pm, step, batch, "save_all", ac)
            if first == "min_cut":
                row["tagged_min_cut"] = _timed(pm, step, batch, "min_cut", ac)
        out["ac" if ac else "no_ac"] = row
        print(f"  {n_layers} layers, AC {ac}: {row}", file=sys.stderr, flush=True)
    return out


def run(
    quick: bool = False, layers: tuple[int, ...] = LAYERS, seq: int = SEQ, vocab: int = VOCAB
) -> dict[str, Any]:
    if quick:  # meta tensors: no memory, but three 8B-shaped traces take minutes
        layers, seq, vocab = (1, 2), 256, 256
    start = time.perf_counter()
    with fake_world(WORLD):
        rows = [measure(n, seq=seq, vocab=vocab) for n in layers]
    by_layers = {r["layers"]: r for r in rows}
    one, two = by_layers[1], by_layers[2]
    three = by_layers.get(3)
    projected: dict[str, dict[str, Any]] = {}
    for mode in ("no_ac", "ac"):
        for key, _ in PARTITIONS:
            a, b = one[mode][key]["bytes"], two[mode][key]["bytes"]
            per_layer = b - a
            entry: dict[str, Any] = {
                "one_layer": a,
                "per_layer": per_layer,
                "full": a + (FULL_LAYERS - 1) * per_layer,
                "per_layer_ag": two[mode][key]["all_gather_count"]
                - one[mode][key]["all_gather_count"],
            }
            if three is not None:
                entry["linear"] = three[mode][key]["bytes"] - b == per_layer
            projected[f"{mode}/{key}"] = entry
    return {
        "world": WORLD,
        "seq": seq,
        "batch": BATCH,
        "vocab": vocab,
        "layers": list(layers),
        "params_per_layer": two["full_params"] - one["full_params"],
        "rows": rows,
        "projected": projected,
        "wall_s": round(time.perf_counter() - start, 1),
        "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
    }


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f}"


def _ratio(a: int, b: int) -> str:
    if b == 0:
        return "0 = 0" if a == 0 else "– (÷ 0)"
    return f"{a / b:.2f}"


def markdown(result: dict[str, Any]) -> str:
    rows = []
    proj = result["projected"]
    for mode, ac_label in (("no_ac", "off"), ("ac", "on")):
        plain = proj[f"{mode}/plain"]["full"]
        tagged = proj[f"{mode}/tagged_min_cut"]["full"]
        for key, label in PARTITIONS:
            p = proj[f"{mode}/{key}"]
            linear = p.get("linear")
            measured = " / ".join(_gb(r[mode][key]["bytes"]) for r in result["rows"])
            full = [_gb(p["full"]), _ratio(p["full"], plain), _ratio(p["full"], tagged)]
            if linear is False:  # AC stages span layers: no per-layer projection
                full = ["n/a (not linear)", "–", "–"]
            rows.append(
                [
                    ac_label,
                    label,
                    measured,
                    _gb(p["per_layer"]),
                    "–" if linear is None else ("yes" if linear else "**no**"),
                    p["per_layer_ag"],
                    *full,
                ]
            )
    columns = (
        ("AC", "l"),
        ("partition", "l"),
        ("measured at " + " / ".join(str(n) for n in result["layers"]) + " layers (GB)", "r"),
        ("per layer (GB)", "r"),
        ("3-2 = 2-1 layers", "l"),
        ("all-gather outputs saved per layer", "r"),
        (f"{FULL_LAYERS} layers (GB)", "r"),
        ("/ plain", "r"),
        ("/ tagged min-cut", "r"),
    )
    head = (
        f"LLaMA-3 8B layers (torchtitan `_8b` config, {result['params_per_layer']:,} parameters "
        f"per layer, vocabulary {result['vocab']:,}), bf16 parameters, FSDP world "
        f"{result['world']} (fake PG), sequence {result['seq']}, batch {result['batch']} per "
        f"rank; layers measured {result['layers']} on meta tensors (nothing executed). Saved "
        "bytes per rank = every storage the forward saves for the backward "
        f"(`SavedSummary.nbytes`); {FULL_LAYERS} layers = 1 layer + "
        f"{FULL_LAYERS - 1} x per layer, where the per-layer bytes are linear (3 - 2 = 2 - 1 "
        "layers); with AC they need not be (ap-tags' AC pass, "
        '`ac_stage_size_gib="auto"`, places its cuts over the whole forward: fewer layers than '
        "the head's segment is long get one cut), so a non-linear AC row gives the measured "
        "figures only. "
        "GB = 1e9 bytes."
    )
    return f"{head}\n\n{markdown_table(columns, rows)}"


if __name__ == "__main__":
    print(markdown(run(quick="--quick" in sys.argv)))
