"""Eager-vs-compiled training on one rank: the shared core of the demo, the cross-package
tests and the e2e benchmark.

Every model is built from the same seed, so the eager reference and each compiled variant
start from identical (sharded) weights and see identical per-(step, rank) batches; after each
step the parameters take the same SGD update, so step ``k`` compares like with like.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import ap_tags
import torch
from torch import nn

from ap_backend import _compat
from ap_backend._backend import autoparallel_backend
from ap_backend._measure import measure_saved
from ap_backend._precompile import precompile
from ap_backend.demo._simple_fsdp import local_tensor, simple_fsdp
from ap_backend.models import ModelConfig, Sharding, Transformer, single_rank_sharding

__all__ = ["TrainSpec", "Variant", "run_rank"]


@dataclass(frozen=True)
class Variant:
    """One compiled configuration: ``backend_kwargs`` go to ``autoparallel_backend``;
    ``backend="inductor"`` compiles the *eager* module with stock Inductor instead (benchmark
    baseline) and ``backend="eager"`` just times the eager module."""

    name: str
    backend_kwargs: dict[str, Any] = field(default_factory=dict)
    backend: str = "autoparallel"
    #: also run the AC staging pass in the first compilation, with the backend's
    #: ``ac_stage_size_gib`` (both compilations then run the same AC pass)
    first_compile_ac: bool = False


@dataclass(frozen=True)
class TrainSpec:
    """One training job: the model, the compiled variants compared against eager, the steps
    and SGD learning rate, the comparison tolerances, and whether to also measure the min-cut
    + AC saved sets (with and without the first compilation)."""

    model: ModelConfig
    variants: tuple[Variant, ...]
    steps: int = 4
    lr: float = 0.05
    gather_dtype: str | None = None
    measure_min_cut_ac: bool = False
    #: AC stage size for the min-cut + AC measurements
    min_cut_ac_stage_gib: float | Literal["auto"] = "auto"
    rtol: float = 1e-5
    atol: float = 1e-6
    progress: bool = False
    #: the FSDP engine: ``"ap"`` (the model kit's functional all-gathers, no extra
    #: dependency) or ``"simple"`` (torchtitan's SimpleFSDP: DTensor parameters)
    fsdp: Literal["ap", "simple"] = "ap"
    #: also measure what plain ``torch.compile`` (min-cut, no AC, no first compilation) saves
    measure_plain: bool = False
    #: where the models and batches live (``"cuda"``: the rank's current CUDA device)
    device: str = "cpu"


def _model(spec: TrainSpec, sharding: Sharding) -> nn.Module:
    """The model every run starts from (same seed, same weights), on ``spec.device``."""
    model = _built_model(spec, sharding)
    return model if spec.device == "cpu" else model.to(spec.device)


def _built_model(spec: TrainSpec, sharding: Sharding) -> nn.Module:
    """Sharded by the model kit, or built unsharded and handed to SimpleFSDP."""
    if spec.fsdp == "simple":
        if spec.model.ep:
            raise ValueError(
                "TrainSpec: fsdp='simple' cannot run the expert-parallel MoE (ModelConfig.ep); "
                "use fsdp='ap'"
            )
        return simple_fsdp(Transformer(spec.model, single_rank_sharding()), sharding.world_size)
    return Transformer(spec.model, sharding)


def _scalar_reads_traced(spec: TrainSpec) -> contextlib.AbstractContextManager[Any]:
    """Plain ``torch.compile`` of the expert-parallel model (no first compilation): Dynamo
    traces the split sizes' ``.tolist()`` as unbacked symbols (``capture_scalar_outputs``,
    torchtitan's setting for EP) instead of breaking the graph there, so the measured
    partition is the whole step's."""
    if spec.model.ep:
        return _compat.dynamo_config_patch({"capture_scalar_outputs": True})
    return contextlib.nullcontext()


def _eager_model(spec: TrainSpec, sharding: Sharding, chunk: Any) -> nn.Module:
    model = _model(spec, sharding)
    if chunk is not None:
        from ap_epchunk import EagerChunked

        layers: Any = model.layers
        for block in layers:
            moe = getattr(block, "moe", None)
            if moe is not None:
                block.moe = EagerChunked(moe, chunk.dim, chunk.num_chunks)
    return model


def _train(
    step_fn: Callable[[int], torch.Tensor], params: list[nn.Parameter], steps: int, lr: float
) -> tuple[list[float], list[list[torch.Tensor]], list[float]]:
    losses: list[float] = []
    grads: list[list[torch.Tensor]] = []
    seconds: list[float] = []
    for step in range(steps):
        for p in params:
            p.grad = None
        start = time.perf_counter()
        loss = step_fn(step)
        loss.backward()  # type: ignore[no-untyped-call]
        seconds.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
        grads.append(
            [
                local_tensor(p.grad.detach()).clone()
                if p.grad is not None
                else torch.zeros_like(local_tensor(p.detach()))
                for p in params
            ]
        )
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.sub_(lr * p.grad)
    return losses, grads, seconds


def _mismatches(
    names: list[str],
    ref: list[list[torch.Tensor]],
    got: list[list[torch.Tensor]],
    ref_loss: list[float],
    got_loss: list[float],
    rtol: float,
    atol: float,
) -> tuple[list[str], float]:
    problems: list[str] = []
    worst = 0.0
    for step, (r_step, g_step) in enumerate(zip(ref, got, strict=True)):
        try:
            torch.testing.assert_close(
                torch.tensor(got_loss[step]), torch.tensor(ref_loss[step]), rtol=rtol, atol=atol
            )
        except AssertionError as exc:
            problems.append(f"step {step + 1} loss: {exc}".splitlines()[0])
        for name, r, g in zip(names, r_step, g_step, strict=True):
            worst = max(worst, float((g - r).abs().max() / r.abs().max().clamp_min(1e-12)))
            try:
                torch.testing.assert_close(g, r, rtol=rtol, atol=atol)
            except AssertionError as exc:
                problems.append(f"step {step + 1} grad {name}: {str(exc).splitlines()[-1]}")
    return problems, worst


def _say(spec: TrainSpec, rank: int, msg: str) -> None:
    if spec.progress and rank == 0:
        print(f"[ap-backend demo] {msg}", flush=True)


def run_rank(rank: int, world_size: int, spec: TrainSpec) -> dict[str, Any]:
    """Per-rank job: eager reference, then each variant; returns plain numbers only.

    Runs with Inductor's FX-graph and AOTAutograd caches off: a warm cache skips the custom
    partitioner, and there would be no partition to measure."""
    dtype = getattr(torch, spec.gather_dtype) if spec.gather_dtype else None
    sharding = Sharding.from_world(dtype)
    chunks = [v.backend_kwargs.get("ep_chunk") for v in spec.variants]
    chunk = next((c for c in chunks if c is not None), None)
    result: dict[str, Any] = {"rank": rank, "variants": {}}
    with (
        _compat.inductor_config_patch({"fx_graph_cache": False}),
        _compat.functorch_config_patch({"enable_autograd_cache": False}),
    ):
        eager = _eager_model(spec, sharding, chunk)
        names = [n for n, _ in eager.named_parameters()]
        batches = [
            _on(spec.device, Transformer.example_batch(eager, s, rank))  # type: ignore[arg-type]
            for s in range(spec.steps)
        ]
        _say(spec, rank, f"eager reference: {spec.steps} steps")
        e_loss, e_grads, e_secs = _train(
            lambda s: eager(*batches[s]), list(eager.parameters()), spec.steps, spec.lr
        )
        result["eager"] = {"losses": e_loss, "step_s": statistics.median(e_secs)}
        for variant in spec.variants:
            torch.compiler.reset()
            _say(spec, rank, f"{variant.name}: first compilation + torch.compile")
            out = _run_variant(spec, sharding, variant, batches, names)
            out["mismatches"], out["max_grad_rel_diff"] = _mismatches(
                names, e_grads, out.pop("grads"), e_loss, out["losses"], spec.rtol, spec.atol
            )
            result["variants"][variant.name] = out
        if spec.measure_min_cut_ac:
            torch.compiler.reset()
            _say(spec, rank, "measuring min-cut + AC saved sets (tagged and untagged)")
            stage = spec.min_cut_ac_stage_gib
            model = _model(spec, sharding)
            first_ac = any(v.first_compile_ac for v in spec.variants)
            pm = precompile(
                model, batches[0], joint_pass=ap_tags.ac_joint_pass(stage) if first_ac else None
            )
            result["min_cut_ac"] = measure_saved(pm, batches[0], ac_stage_size_gib=stage).to_dict()
            torch.compiler.reset()
            plain = _model(spec, sharding)
            with _scalar_reads_traced(spec):
                result["min_cut_ac_untagged"] = measure_saved(
                    plain, batches[0], ac_stage_size_gib=stage
                ).to_dict()
        if spec.measure_plain:
            torch.compiler.reset()
            _say(spec, rank, "measuring plain torch.compile's saved set (min-cut, no AC)")
            with _scalar_reads_traced(spec):
                result["plain_compile"] = measure_saved(
                    _model(spec, sharding), batches[0], partitioner="min_cut", enable_ac=False
                ).to_dict()
    return result


def _on(device: str, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return batch if device == "cpu" else (batch[0].to(device), batch[1].to(device))


def _mark_token_inputs(kwargs: dict[str, Any], batch: tuple[torch.Tensor, ...]) -> None:
    """The documented token route of ``autoparallel_backend(ep_chunk=...)``: mark the token dim
    of the tensors the compiled module is first called with (tokens and targets, dim 0)."""
    if kwargs.get("ep_chunk") is None:
        return
    from ap_epchunk import mark_chunk_dim

    for t in batch:
        mark_chunk_dim(t, 0, hint=None)


def _region(region: Any) -> dict[str, Any]:
    """One chunked region of an ``ap_epchunk.ChunkReport``, as plain values."""
    return {
        "root": str(region.root),
        "backward": bool(region.backward),
        "all_to_alls": int(region.all_to_alls),
        "whole_collectives": [str(w) for w in region.whole_collectives],
    }


def _run_variant(
    spec: TrainSpec,
    sharding: Sharding,
    variant: Variant,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    names: list[str],
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = _model(spec, sharding)
    if variant.backend == "autoparallel":
        t0 = time.perf_counter()
        joint_pass = None
        if variant.first_compile_ac:
            stage = variant.backend_kwargs.get("ac_stage_size_gib", "auto")
            joint_pass = ap_tags.ac_joint_pass(stage)
        _mark_token_inputs(variant.backend_kwargs, batches[0])
        pm = precompile(model, batches[0], joint_pass=joint_pass)
        out["precompile_s"] = time.perf_counter() - t0
        out["first_partition"] = {
            "partitioner": pm.first_partitioner,
            **pm.first_partition.to_dict(),
        }
        out["fsdp_chains"] = len(pm.fsdp_report.chains)
        out["n_params"] = len(list(model.parameters()))
        backend = autoparallel_backend(**variant.backend_kwargs)
        compiled: Callable[..., torch.Tensor] = torch.compile(pm, backend=backend)
    elif variant.backend == "inductor":
        backend = None
        compiled = torch.compile(model)
    else:
        backend = None
        compiled = model
    losses, grads, secs = _train(
        lambda s: compiled(*batches[s]), list(model.parameters()), spec.steps, spec.lr
    )
    out["losses"] = losses
    out["grads"] = grads
    out["first_step_s"] = secs[0]
    out["step_s"] = statistics.median(secs[1:]) if len(secs) > 1 else secs[0]
    out["step_s_all"] = secs
    if backend is not None:
        out["saved"] = [s.to_dict() for s in backend.saved]
        out["fell_back"] = [bool(getattr(r, "fell_back", False)) for r in backend.partition_reports]
        out["buckets"] = [int(getattr(s, "buckets", 0)) for s in backend.bucketing_stats]
        out["chunk_reports"] = len(backend.chunk_reports)
        out["chunk_regions"] = [_region(r) for rep in backend.chunk_reports for r in rep.regions]
        out["backend_compile_s"] = sum(backend.compile_seconds)
        out["inner_compiles"] = backend.inner_compiles
    assert len(names) == len(grads[0])
    return out
