"""``ap_backend.demo``: the application around the backend -- gloo ranks, a training loop
checked against eager, and the ``ap-backend demo`` table.

The library (:func:`ap_backend.autoparallel_backend`, :func:`ap_backend.precompile`) never
spawns processes or trains; this subpackage does, and the console script, the cross-package
tests and the end-to-end benchmark all drive it through these names:

* :class:`TrainSpec` / :class:`Variant` / :func:`run_rank` -- one rank's job: an eager
  reference, then each compiled variant (two-stage ``precompile`` + ``autoparallel_backend``,
  stock Inductor, or eager) trained from the same seed on the same per-(step, rank) batches;
  returns plain numbers (losses, grad mismatches, saved sets, buckets, timings).
* :func:`spawn_ranks` / :class:`RankError` / :func:`free_port` -- run a function on N local
  gloo ranks (127.0.0.1) and collect one result per rank; a failing rank's traceback is
  re-raised in the parent as :class:`RankError`.
* :func:`simple_fsdp` / :func:`require_simple_fsdp` -- the demo model on torchtitan's
  SimpleFSDP (``TrainSpec(fsdp="simple")``, ``ap-backend demo --fsdp simple``); torchtitan is
  imported only then.
* :class:`DemoOptions` / :func:`build_spec` / :func:`run_demo` / :func:`summarize` /
  :func:`render_table` (:func:`expert_parallel_summary`: ``--chunk``'s all-to-alls per MoE
  layer) -- what ``ap-backend demo`` runs and prints::

      from ap_backend.demo import DemoOptions, render_table, run_demo

      print(render_table(run_demo(DemoOptions(layers=2, steps=2))))
"""

from ap_backend.demo._run import (
    DEMO_AC_STAGE_GIB,
    DemoOptions,
    build_spec,
    expert_parallel_summary,
    run_demo,
    summarize,
)
from ap_backend.demo._simple_fsdp import require_simple_fsdp, simple_fsdp
from ap_backend.demo._spawn import RankError, free_port, spawn_ranks
from ap_backend.demo._table import render_table
from ap_backend.demo._train import TrainSpec, Variant, run_rank

__all__ = [
    "DEMO_AC_STAGE_GIB",
    "DemoOptions",
    "RankError",
    "TrainSpec",
    "Variant",
    "build_spec",
    "expert_parallel_summary",
    "free_port",
    "render_table",
    "require_simple_fsdp",
    "run_demo",
    "run_rank",
    "simple_fsdp",
    "spawn_ranks",
    "summarize",
]
