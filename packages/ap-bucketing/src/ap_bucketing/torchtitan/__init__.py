"""ap-bucketing in torchtitan's graph_trainer: one flag to train any of its configs with it.

::

    torchrun --nproc-per-node 8 -m torchtitan.train \\
        --module ap_bucketing.torchtitan.llama3 --config graph_trainer_llama3_8b \\
        --compile.pass_pipeline ap

``--module ap_bucketing.torchtitan.<model>`` (``llama3``, ``qwen3``, ``deepseek_v3``) offers
every ``graph_trainer_*`` config of graph_trainer's own module of that name, unchanged, and
registers the pass pipeline ``"ap"``: graph_trainer's default pipeline
(``construct_default_graph_passes``) with its ``joint_transformer_block_bucketing_reordering_pass``
replaced by :func:`ap_bucketing_pass` -- ap-bucketing's ``OverlapBucketingPass`` (:data:`CONFIG`:
block-wide buckets in the copy-free coalesced form, ap's FSDP prefetch schedule) on the traced
joint graph (forward, loss and ``autograd.grad`` in one graph), then the rest of graph_trainer's
passes (``regional`` or ``full`` Inductor) as before. Without ``--compile.pass_pipeline ap``
the run is graph_trainer's own.

This subpackage is the only place ap-bucketing imports torchtitan: ``import ap_bucketing``
needs torch alone. Registering a pipeline is torchtitan's own extension point
(``torchtitan.experiments.graph_trainer.registry``), done when a config module here is
imported (what ``--module`` does); nothing in torch is patched.

The joint graph is not functional (``make_fx`` without functionalization: graph_trainer's
chunked loss writes gradients with ``copy_`` into slices of a buffer the backward reads), and
``OverlapBucketingPass`` keeps its in-place write order (``ap_bucketing._hazards``). Buckets are
one transformer block wide, as graph_trainer's own ``get_transformer_block_buckets`` are: the
block comes from the ``module_fqn`` graph_trainer stamps on every node.

Refused, naming the option: ``--compile.enable_fsdp_dense_region_overlap`` and
``--compile.ep_overlap.enabled`` (their passes read graph_trainer's own bucket metadata).
A precompiled artifact (``--compile.precompile_artifact_dir``) carries the passes it was built
with; build it with graph_trainer's ``precompile_main``, which does not read pipelines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch.fx as fx

from .._config import BucketingConfig, resolve_config
from .._overlap import PREFETCH, OverlapBucketingPass

__all__ = [
    "CONFIG",
    "PASS_NAME",
    "PIPELINE",
    "REPLACED_PASS",
    "ap_bucketing_pass",
    "ap_pass_pipeline",
    "make_bucketing_pass",
    "pipeline_with",
    "register_pipeline",
    "reexport_configs",
]

log = logging.getLogger(__name__)

#: The ``--compile.pass_pipeline`` name this package registers.
PIPELINE = "ap"
#: graph_trainer's pass that the ``"ap"`` pipeline replaces.
REPLACED_PASS = "joint_transformer_block_bucketing_reordering_pass"
#: The name of the replacing pass (``--compile.disable_passes ap_bucketing_pass`` disables it).
PASS_NAME = "ap_bucketing_pass"

GraphPass = Callable[[fx.GraphModule, Any], fx.GraphModule]


def make_bucketing_pass(
    config: BucketingConfig | None = None,
    *,
    reorder: bool | str = PREFETCH,
    **schedule_overrides: object,
) -> GraphPass:
    """A graph_trainer pass (``(gm, example_inputs) -> gm``) running ``OverlapBucketingPass``
    with these options on the joint graph. Each run's report (collectives before -> after,
    nodes moved back into write order, ``skipped``) is left in ``gm.meta["ap_bucketing"]``
    with the pass's wall time, and logged.

    ``reorder`` defaults to ``"prefetch"``: graph_trainer runs the joint graph in its own
    order, so the order is the memory; ap's FSDP prefetch schedule issues each block's
    all-gather right after the previous block's wait, as graph_trainer's own pass does
    (torch's overlap scheduler, ``reorder=True``, is tuned for Inductor's later reordering
    and held 2.3x graph_trainer's gathered bytes on Llama3's debug model)."""
    cfg = resolve_config(config, where="make_bucketing_pass")

    def ap_bucketing_pass(gm: fx.GraphModule, example_inputs: Any = None) -> fx.GraphModule:
        del example_inputs
        bucketing = OverlapBucketingPass(cfg, cpu=None, reorder=reorder, **schedule_overrides)
        start = time.perf_counter()
        bucketing(gm.graph)
        gm.graph.lint()
        gm.recompile()
        report: dict[str, Any] = dict(bucketing.reports[-1]) if bucketing.reports else {}
        elapsed = report["elapsed_s"] = time.perf_counter() - start
        gm.meta["ap_bucketing"] = report
        counts: dict[str, tuple[int, int]] = report.get("collectives", {})
        log.info(
            "ap_bucketing_pass: %s in %.2f s%s",
            ", ".join(f"{k} {b} -> {a}" for k, (b, a) in counts.items()),
            elapsed,
            f" (skipped: {report['skipped']})" if report.get("skipped") else "",
        )
        return gm

    ap_bucketing_pass.__name__ = ap_bucketing_pass.__qualname__ = PASS_NAME
    return ap_bucketing_pass


#: The config of the ``"ap"`` pipeline: ``BucketingConfig()`` (block-wide buckets, prefetch
#: window of one) in the copy-free form: graph_trainer runs the joint graph as ordered, and the
#: ``"custom_ops"`` form's flat buffer sits beside the member copies at every unpack (Llama3
#: debug: 1.63 MiB of gathered weights alive at most, against 4.88 MiB for that form and for
#: graph_trainer's own pass).
CONFIG = BucketingConfig(bucket_mode="coalesced")

#: The pass the ``"ap"`` pipeline uses: :data:`CONFIG`, ap's FSDP prefetch schedule.
ap_bucketing_pass: GraphPass = make_bucketing_pass(CONFIG)


def _refuse_unsupported(config: Any) -> None:
    compile_config = config.compile
    if getattr(compile_config, "enable_fsdp_dense_region_overlap", False):
        raise ValueError(
            f"--compile.pass_pipeline {PIPELINE}: --compile.enable_fsdp_dense_region_overlap "
            "is not supported (its pass reads graph_trainer's own bucket metadata); drop the "
            "option or use graph_trainer's default pipeline"
        )
    ep_overlap = getattr(compile_config, "ep_overlap", None)
    if getattr(ep_overlap, "enabled", False):
        raise ValueError(
            f"--compile.pass_pipeline {PIPELINE}: --compile.ep_overlap.enabled is not "
            "supported (its scheduling pass expects graph_trainer's own FSDP buckets); drop "
            "the option or use graph_trainer's default pipeline"
        )


def pipeline_with(bucketing_pass: GraphPass) -> Callable[..., list[Callable[..., Any]]]:
    """A graph_trainer pass pipeline: its default one with :data:`REPLACED_PASS` replaced by
    ``bucketing_pass``."""
    from torchtitan.experiments.graph_trainer.passes import (
        _get_pass_name,
        construct_default_graph_passes,
    )

    def pipeline(
        traced_result: Any, config: Any, *, parallel_dims: Any = None
    ) -> list[Callable[..., Any]]:
        _refuse_unsupported(config)
        passes: list[Callable[..., Any]] = list(
            construct_default_graph_passes(traced_result, config, parallel_dims=parallel_dims)
        )
        names = [_get_pass_name(p) for p in passes]
        if REPLACED_PASS not in names:
            if getattr(config.compile, "precompile_artifact_dir", None):
                log.warning(
                    "--compile.pass_pipeline %s: a precompiled artifact carries the passes it "
                    "was built with; ap-bucketing does not run",
                    PIPELINE,
                )
                return passes
            raise RuntimeError(
                f"--compile.pass_pipeline {PIPELINE}: graph_trainer's default pipeline has no "
                f"{REPLACED_PASS} to replace (passes: {', '.join(names)}); this torchtitan is "
                "not one ap_bucketing.torchtitan supports"
            )
        return [
            bucketing_pass if n == REPLACED_PASS else p for p, n in zip(passes, names, strict=True)
        ]

    return pipeline


def ap_pass_pipeline(
    traced_result: Any, config: Any, *, parallel_dims: Any = None
) -> list[Callable[..., Any]]:
    """The ``"ap"`` pipeline: graph_trainer's default with :func:`ap_bucketing_pass`."""
    return pipeline_with(ap_bucketing_pass)(traced_result, config, parallel_dims=parallel_dims)


def register_pipeline(
    name: str = PIPELINE, pipeline: Callable[..., list[Callable[..., Any]]] = ap_pass_pipeline
) -> None:
    """Register ``pipeline`` under ``name`` in graph_trainer's pass-pipeline registry
    (idempotent; another name with another :func:`pipeline_with` for other options)."""
    from torchtitan.experiments.graph_trainer.registry import register_pass_pipeline

    register_pass_pipeline(name)(pipeline)


def reexport_configs(model: str, namespace: dict[str, Any]) -> list[str]:
    """Copy every ``graph_trainer_*`` config function of graph_trainer's ``model`` module into
    ``namespace`` (a config module here) and register the ``"ap"`` pipeline; returns the
    names."""
    import importlib

    source = importlib.import_module(
        f"torchtitan.experiments.graph_trainer.{model}.config_registry"
    )
    names = sorted(
        n for n in vars(source) if n.startswith("graph_trainer_") and callable(getattr(source, n))
    )
    for n in names:
        namespace[n] = getattr(source, n)
    register_pipeline()
    return names
