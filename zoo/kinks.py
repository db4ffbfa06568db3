"""How far fp32 determines a zoo model's gradients: ``python -m zoo.kinks [--models tv_resnet18]``.

A ReLU network's gradient is discontinuous where a pre-activation crosses zero. Where its
BatchNorms normalise over few values (ResNets on 32x32 images: ``layer4`` sees 1x1 maps, 16
values per channel), one element landing on the other side of a kink moves a BatchNorm
gradient by a sizeable fraction. After an SGD step some pre-activation sits within round-off of
zero, so *any* change of rounding can flip it: eager fp32 against eager fp64, eager fp32 on
parameters jittered by one ulp, and plain ``torch.compile`` (a different reduction order) all
land on either side. This script measures that, in one process, on the zoo's own model and
batches (no FSDP, no ap package), per SGD step:

* ``fp32 vs fp64``: eager fp32 against eager fp64 (the exact answer's stand-in);
* ``ulp jitter``: eager fp32 with every parameter multiplied by ``1 +- 2**-24`` (one of
  ``--seeds`` random sign patterns each) against unjittered eager fp32 -- the spread fp32
  rounding alone gives the gradient; the worst seed and how many seeds moved it beyond the
  fp32 gradient tolerance;
* ``stock compile``: plain ``torch.compile`` (Inductor) against eager fp32.

Where the jitter spread reaches the compiled gap, the gradient is not determined by fp32 to
the zoo's tolerance, and a compiled run can only be judged against stock ``torch.compile`` of
the same step (``zoo.run.matches_stock_where_undetermined``). Each value is the worst
per-tensor normwise relative error (the zoo's gradient measure, with its floor).
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")

import argparse  # noqa: E402
import copy  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from zoo.models import MODELS  # noqa: E402
from zoo.models._base import ZooModel  # noqa: E402
from zoo.run import FP32_GRAD_RTOL, LR, _grads_rel, jitter_one_ulp  # noqa: E402

Grads = list[dict[str, torch.Tensor]]


def _loss(zm: ZooModel, module: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    args, kwargs, rest = zm.split(batch)
    out: torch.Tensor = zm.loss_fn(module(*args, **kwargs), *rest)
    return out


def train(
    zm: ZooModel,
    dtype: torch.dtype = torch.float32,
    *,
    jitter_seed: int | None = None,
    wrap: Callable[[nn.Module], Any] | None = None,
) -> Grads:
    """SGD on ``zm``'s batches (one step each) from a copy of its initial state; each step's
    gradients by parameter name."""
    module = copy.deepcopy(zm.module).to(dtype)
    if jitter_seed is not None:
        jitter_one_ulp(module, jitter_seed)
    fn = module if wrap is None else wrap(module)
    params = dict(module.named_parameters())
    out: Grads = []
    for batch in zm.batches:
        cast = tuple(t.to(dtype) if t.is_floating_point() else t for t in batch)
        _loss(zm, fn, cast).backward()  # type: ignore[no-untyped-call]
        with torch.no_grad():
            out.append(
                {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}
            )
            for p in params.values():
                if p.grad is not None:
                    p.sub_(LR * p.grad)
                    p.grad = None
    return out


def worst(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The zoo's gradient measure (``zoo.run._grads_rel``) on one step: the worst per-tensor
    normwise error, with its floor, and which parameter."""
    err, where = _grads_rel([got], [ref])
    return err, where.removeprefix("step 1 ")


def measure(name: str, seeds: int, steps: int = 2) -> list[str]:
    """Table rows (one per step) for model ``name``."""
    zm = MODELS[name](steps)
    ref64 = train(zm, torch.float64)
    eager = train(zm)
    jittered = [train(zm, jitter_seed=s) for s in range(seeds)]
    torch._dynamo.reset()
    compiled = train(zm, wrap=torch.compile)
    rows = []
    for step in range(steps):
        spread = [worst(j[step], eager[step]) for j in jittered]
        top, where = max(spread)
        moved = sum(1 for e, _ in spread if e > FP32_GRAD_RTOL)
        fp64, fp64_at = worst(eager[step], ref64[step])
        comp, comp_at = worst(compiled[step], eager[step])
        rows.append(
            f"| {name} | {step + 1} | {fp64:.1e} (`{fp64_at}`) | {top:.1e} (`{where}`) | "
            f"{moved} / {seeds} | {comp:.1e} (`{comp_at}`) |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zoo.kinks", description=__doc__)
    parser.add_argument("--models", default="tv_resnet18,timm_resnet10t")
    parser.add_argument("--seeds", type=int, default=8)
    args = parser.parse_args(argv)
    print(
        "| model | step | eager fp32 vs fp64 | ulp jitter: worst seed vs eager fp32 | "
        f"seeds beyond {FP32_GRAD_RTOL:.0e} | stock compile vs eager fp32 |"
    )
    print("|---|---:|---|---|---:|---|")
    for name in args.models.split(","):
        for row in measure(name.strip(), args.seeds):
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
