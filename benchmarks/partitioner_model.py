"""A small FSDP-style transformer and the two-stage compile, for the partitioner benchmark.

Duplicated from ap-partitioner's integration tests on purpose (benchmarks may not import test
code, and this module must not import ap_backend). Parameters are dim-0 shards all-gathered in
forward with autograd-aware functional collectives on the fake process group (world size 8):
the graphs are real, the data is garbage, so only structure and times are measured.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import ap_tags
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from ap_partitioner import PartitionReport, report_for

WORLD = 8


def _gather(weight: torch.Tensor) -> torch.Tensor:
    fn = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return fn(weight, 0, dist.group.WORLD)  # type: ignore[no-any-return]


class ShardedLinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, cast: torch.dtype | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out // WORLD, d_in) * 0.02)
        self.cast = cast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cast is None:
            return F.linear(x, _gather(self.weight))
        return F.linear(x.to(self.cast), _gather(self.weight.to(self.cast))).float()


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, cast: torch.dtype | None) -> None:
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (ShardedLinear(dim, dim, cast) for _ in range(4))
        self.w1 = ShardedLinear(dim, 4 * dim, cast)
        self.w2 = ShardedLinear(4 * dim, dim, cast)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        y = F.rms_norm(x, (d,))
        q, k, v = (
            m(y).view(b, s, self.heads, d // self.heads).transpose(1, 2)
            for m in (self.wq, self.wk, self.wv)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, d))
        return x + self.w2(F.silu(self.w1(F.rms_norm(x, (d,)))))


class Transformer(nn.Module):
    def __init__(
        self, layers: int, dim: int = 128, heads: int = 4, cast: torch.dtype | None = torch.bfloat16
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dim, heads, cast) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


@contextlib.contextmanager
def fake_process_group() -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


class FirstCompiled(nn.Module):
    def __init__(self, model: nn.Module, fn: Callable[..., Any], order: list[str]) -> None:
        super().__init__()
        self.model, self.fn, self.order = model, fn, order

    def forward(self, x: torch.Tensor) -> Any:
        params = dict(self.model.named_parameters())
        return self.fn(*[params[n] for n in self.order], x)


@dataclass
class FirstCompile:
    module: nn.Module
    x: torch.Tensor
    report: PartitionReport


def first_compile(layers: int, *, seq: int = 64, dim: int = 128) -> FirstCompile:
    """Export, tag FSDP chains MUST_RECOMPUTE, ``default_partition``, tagging interpreter."""
    from torch._functorch.aot_autograd import (
        aot_compile_joint_with_descriptors,
        aot_export_joint_with_descriptors,
    )
    from torch._functorch.partitioners import default_partition

    torch.manual_seed(0)
    model, x = Transformer(layers, dim), torch.randn(2, seq, dim)
    seen: dict[str, PartitionReport] = {}

    def partition(gm: fx.GraphModule, joint_inputs: Any, **kw: Any) -> Any:
        fw, bw = default_partition(gm, joint_inputs, **kw)
        seen["r"] = report_for(fw, bw, kw["num_fwd_outputs"], partitioner="first")
        return fw, bw

    with contextlib.ExitStack() as stack:
        jd = aot_export_joint_with_descriptors(stack, model, (x,))
        ap_tags.mark_fsdp_all_gather_recomputation(jd.graph_module.graph)
        fn = aot_compile_joint_with_descriptors(
            jd,
            partition_fn=partition,
            fw_compiler=ap_tags.preserve_meta_compiler(tag_forward=True),
            bw_compiler=ap_tags.preserve_meta_compiler(),
        )
        order = list(jd.params_spec)
    return FirstCompile(FirstCompiled(model, fn, order), x, seen["r"])


def _boxed_identity(gm: fx.GraphModule, _example_inputs: Any) -> Any:
    from functorch.compile import make_boxed_func

    return make_boxed_func(gm)


@dataclass
class CapturedJoint:
    """A second-compile joint graph (after the AC joint pass) and the partitioner kwargs."""

    gm: fx.GraphModule
    kwargs: dict[str, Any]

    def fresh(self) -> fx.GraphModule:
        return copy.deepcopy(self.gm)


def ac_pass() -> Callable[..., Any] | None:
    """ap-tags' AC staging joint pass, when this ap-tags has it."""
    make = getattr(ap_tags, "ac_joint_pass", None)
    return None if make is None else make("auto")  # type: ignore[no-any-return]


def second_compile(
    first: FirstCompile, partitioner: Any, *, ac: bool, capture: list[CapturedJoint] | None = None
) -> None:
    """``torch.compile`` the first callable with ``aot_module_simplified`` + identity compilers."""
    from torch._functorch.aot_autograd import aot_module_simplified

    def partition(gm: fx.GraphModule, joint_inputs: Any, **kw: Any) -> Any:
        if capture is not None:
            capture.append(CapturedJoint(copy.deepcopy(gm), dict(kw)))
        return partitioner(gm, joint_inputs, **kw)

    def backend(gm: fx.GraphModule, example_inputs: Any) -> Any:
        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=_boxed_identity,
            bw_compiler=_boxed_identity,
            partition_fn=partition,
        )

    joint_pass = ac_pass() if ac else None
    if ac and joint_pass is None:
        raise RuntimeError("ap_tags.ac_joint_pass is not available in this ap-tags")
    torch._dynamo.reset()
    with torch._functorch.config.patch(joint_custom_pass=joint_pass):
        loss = torch.compile(first.module, backend=backend, fullgraph=True)(first.x)
    loss.backward()
