"""ap-bucketing alone on stock ``torch.compile`` (``python -m zoo.bucketing``).

A trainer that depends on ``ap-bucketing`` and nothing else of this workspace: torchtitan's
Llama3 debug model, stock ``torch.compile`` (Inductor, min-cut partitioner: the forward saves
the gathered weights, so the backward only reduce-scatters) with
``post_grad_custom_post_pass = OverlapBucketingPass(BucketingConfig(...))``, on two FSDP
engines:

* ``fsdp_step``: the zoo's :class:`zoo.fsdp.FsdpTrainStep` (functional all-gathers of dim-0
  shards, reduce-scatter in the backward);
* ``simple_fsdp``: torchtitan's SimpleFSDP (``data_parallel(model, mesh, "fully_shard")``:
  DTensor parameters redistributed by parametrized properties).

Per rank: two SGD steps eager, then the same two compiled; the pass's own report gives each
graph's collectives before -> after (forward and backward), the numerics are compared with
eager. ``--bucketing none`` compiles without the pass (the collectives as stock leaves them).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
from torch import nn

__all__ = ["ENGINES", "build", "run_engine", "run_rank", "train"]

ENGINES = ("fsdp_step", "simple_fsdp")


class _LossOf(nn.Module):
    """A (SimpleFSDP-wrapped) model and the zoo model's loss as one module."""

    def __init__(self, model: nn.Module, loss_fn: Any, n_inputs: int) -> None:
        super().__init__()
        self.model = model
        self._loss_fn = loss_fn
        self._n = n_inputs

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._loss_fn(self.model(*batch[: self._n]), *batch[self._n :])
        return out


def build(engine: str, zm: Any, world: int) -> tuple[nn.Module, list[tuple[str, Any]]]:
    """``zm``'s model sharded by ``engine`` (see the module docstring) as one loss module, and
    the parameters an optimizer steps (the shards)."""
    from zoo.fsdp import FsdpTrainStep

    if engine == "fsdp_step":
        wrapped = FsdpTrainStep(zm.module, zm.loss_fn, n_model_inputs=zm.n_model_inputs)
        params = [(n, p) for n, p in wrapped.named_shards() if isinstance(p, nn.Parameter)]
        step: nn.Module = wrapped
    elif engine == "simple_fsdp":
        from ap_backend.demo import simple_fsdp

        step = _LossOf(simple_fsdp(zm.module, world), zm.loss_fn, zm.n_model_inputs)
        params = list(step.named_parameters())
    else:
        raise ValueError(f"zoo.bucketing: unknown engine {engine!r}; known: {ENGINES}")
    return step, params


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return (t if to_local is None else to_local()).detach().clone()


def train(fn: Any, params: list[tuple[str, Any]], batches: list[Any]) -> tuple[list[float], Any]:
    losses, grads = [], []
    for batch in batches:
        loss = fn(*batch)
        loss.backward()
        losses.append(float(loss.detach()))
        step = {}
        with torch.no_grad():
            for name, p in params:
                if p.grad is not None:
                    step[name] = _local(p.grad)
                    p.sub_(1e-2 * p.grad)
                    p.grad = None
        grads.append(step)
    return losses, grads


def run_rank(rank: int, world: int, engine: str, model: str, bucketing: str) -> dict[str, Any]:
    """One rank's run: eager, then stock compile with (``ours``; ``coalesced``: the copy-free
    bucket form with ap's FSDP schedule) or without (``none``) the pass."""
    from ap_bucketing import BucketingConfig, OverlapBucketingPass

    from zoo.models import MODELS
    from zoo.run import _grads_rel, _loss_rel, _rank_batches, _State

    torch.manual_seed(0)
    zm = MODELS[model](2)
    step, params = build(engine, zm, world)
    batches = _rank_batches(zm, rank)
    state = _State(step)
    ref_losses, ref_grads = train(step, params, batches)
    state.restore()
    if bucketing == "coalesced":  # ap-bucketing's copy-free form, with ap's FSDP schedule
        config = BucketingConfig(max_topo_span=1500, bucket_mode="coalesced")
        bucketing_pass = OverlapBucketingPass(config, reorder="prefetch")
    else:
        bucketing_pass = OverlapBucketingPass(BucketingConfig(max_topo_span=1500), reorder=True)
    torch._dynamo.reset()
    patch = {"post_grad_custom_post_pass": bucketing_pass if bucketing != "none" else None}
    with torch._inductor.config.patch(patch):
        losses, grads = train(torch.compile(step), params, batches)
    return {
        "rank": rank,
        "n_params": len(params),
        "reports": [
            {k: v for k, v in r.items() if k == "collectives"} for r in bucketing_pass.reports
        ],
        "loss_rel": _loss_rel(losses, ref_losses),
        "grad_rel": _grads_rel(grads, ref_grads)[0],
    }


def run_engine(engine: str, model: str = "tt_llama3", bucketing: str = "ours") -> list[Any]:
    """Both ranks' records of one engine (2 gloo ranks)."""
    from ap_backend.demo import spawn_ranks

    return spawn_ranks(run_rank, 2, engine, model, bucketing, timeout_s=900.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zoo.bucketing", description=__doc__)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--model", default="tt_llama3")
    parser.add_argument("--bucketing", default="ours", choices=("ours", "none", "coalesced"))
    args = parser.parse_args(argv)
    out = {e: run_engine(e, args.model, args.bucketing) for e in args.engines.split(",")}
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
