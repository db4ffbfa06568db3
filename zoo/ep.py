"""EP chunking of the zoo's MoE models through the backend (``python -m zoo.ep``).

A case: torchtitan's Qwen3-MoE or DeepSeek-V3 debug model, FSDP-wrapped like every zoo row,
compiled with ``autoparallel_backend(ep_chunk=ChunkConfig(("layers.*.moe",), num_chunks=N))``
through the documented token route: the token and target tensors are marked with
``ap_epchunk.mark_chunk_dim(t, 0, hint=None)`` and the first compiled call uses them. Two SGD
steps are compared with eager and with ``EagerChunked`` (every ``layers.*.moe`` run chunk by
chunk in eager), the numerical reference of chunking.

Two things differ from the ``default`` row of the same model, for reasons outside the models:

* the batch is ``EP_BATCH`` = 8 sequences (the zoo's 2 would make one-sequence chunks, which a
  static-size graph cannot tell apart from broadcasting);
* ``precompile`` runs inside ``annotate_module_fqns(model)``: ``FsdpTrainStep`` hides the model
  from ``named_modules()`` (it is not a submodule), and the chunk pass selects regions by the
  module FQNs that annotation records.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from zoo.models import MODELS
from zoo.models._base import ZooModel, token_batches
from zoo.run import (
    _first_line,
    _grads_rel,
    _loss_rel,
    _shard_params,
    _sharded_step,
    _State,
    _train,
)

__all__ = ["EP_BATCH", "EP_MODELS", "EpResult", "run_ep_case"]

EP_MODELS = ("tt_qwen3_moe", "tt_deepseek_v3")
EP_BATCH = 8
PATTERN = "layers.*.moe"


@dataclass
class EpResult:
    model: str
    num_chunks: int
    regions_chunked: int = 0
    chunk_mode: str = ""
    mutation_chains: list[str] = field(default_factory=list)
    #: chunked backend vs eager / vs EagerChunked; EagerChunked vs eager (normwise, see zoo.run)
    loss_rel_eager: float | None = None
    grad_rel_eager: float | None = None
    loss_rel_eager_chunked: float | None = None
    grad_rel_eager_chunked: float | None = None
    eager_chunked_vs_eager_grad: float | None = None
    backend_s: float | None = None
    error: str | None = None


def _eager_chunked(zm: ZooModel, n: int) -> nn.Module:
    """A copy of the model with every ``layers.*.moe`` run chunk by chunk (``EagerChunked``;
    its parameters are named ``layers.<i>.moe.module.<p>``, see :func:`_unwrapped`)."""
    from ap_epchunk import EagerChunked

    model = copy.deepcopy(zm.module)
    for layer in model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers:
        moe = getattr(layer, "moe", None)
        if isinstance(moe, nn.Module):
            layer.moe = EagerChunked(moe, 0, n)
    return model


def _unwrapped(grads: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    return [{k.replace(".moe.module.", ".moe."): v for k, v in g.items()} for g in grads]


def run_ep_case(model: str, num_chunks: int, steps: int = 2) -> EpResult:
    """One case in this process (torch.distributed initialised). Never raises for a model or
    backend failure: see ``EpResult.error``."""
    from ap_backend import autoparallel_backend, precompile
    from ap_epchunk import ChunkConfig, mark_chunk_dim
    from ap_tags import annotate_module_fqns

    res = EpResult(model, num_chunks)
    torch._dynamo.reset()
    try:
        zm = MODELS[model](steps)
        zm.batches = list(token_batches(steps, batch=EP_BATCH))
        ref_model = _eager_chunked(zm, max(num_chunks, 2))
        step = _sharded_step(zm)
        params = _shard_params(step)
        state = _State(step)
        ref_losses, ref_grads = _train(step, params, zm.batches)
        state.restore()
        ec_step = _sharded_step(zm, ref_model)
        ec_losses, ec_grads = _train(ec_step, _shard_params(ec_step), zm.batches)
        ec_grads = _unwrapped(ec_grads)
        for t in zm.batches[0]:  # the documented token route: mark, then compile on them
            mark_chunk_dim(t, 0, hint=None)
        with annotate_module_fqns(zm.module):
            pm = precompile(step, zm.batches[0])
        state.restore()
        # num_chunks=1: the unchunked backend on the same batch (the bf16 gap to compare with)
        chunk = ChunkConfig((PATTERN,), num_chunks=num_chunks) if num_chunks > 1 else None
        backend = autoparallel_backend(ep_chunk=chunk)
        compiled = torch.compile(pm, backend=backend)
        start = time.perf_counter()
        losses, grads = _train(compiled, params, zm.batches)
        res.backend_s = time.perf_counter() - start
        if backend.chunk_reports:
            report = backend.chunk_reports[-1]
            res.regions_chunked = len(report.regions)
            res.chunk_mode = report.mode
            res.mutation_chains = list(report.mutation_chains)
        res.loss_rel_eager = _loss_rel(losses, ref_losses)
        res.grad_rel_eager = _grads_rel(grads, ref_grads)[0]
        res.loss_rel_eager_chunked = _loss_rel(losses, ec_losses)
        res.grad_rel_eager_chunked = _grads_rel(grads, ec_grads)[0]
        res.eager_chunked_vs_eager_grad = _grads_rel(ec_grads, ref_grads)[0]
    except Exception as exc:  # noqa: BLE001 - recorded, like every zoo case
        res.error = _first_line(exc)
    finally:
        torch._dynamo.reset()
    return res


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    parser = argparse.ArgumentParser(prog="python -m zoo.ep", description=__doc__)
    parser.add_argument("--models", default=",".join(EP_MODELS))
    parser.add_argument("--chunks", default="2,4", help="1: the unchunked backend")
    args = parser.parse_args(argv)
    with tempfile.NamedTemporaryFile() as f:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore(f.name, 1))  # type: ignore[attr-defined]
        try:
            for name in args.models.split(","):
                for n in (int(c) for c in args.chunks.split(",")):
                    print(json.dumps(dataclasses.asdict(run_ep_case(name, n))), flush=True)
        finally:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
