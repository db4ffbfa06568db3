"""SDPA through the two-stage path: SaveAll replays the first saved set, never falls back.

With AC in the first compilation, torch's ``default_partition`` keeps SDPA's logsumexp but
recomputes its output in the backward (it never saves a multi-output tuple, even when tagged
``MUST_SAVE``). The second compilation retraces that backward, so its joint holds a second,
backward-side copy of the SDPA op. Two rules used to break the replay there:

* the cut check called every ``nondeterministic_seeded`` op random, SDPA included, so it
  refused to recompute that copy and fell back to min-cut ("the backward needs values that
  are neither saved nor recomputable: _scaled_dot_product_flash_attention_for_cpu_2");
  torch's own partitioners (``is_rng_op``) treat SDPA with ``dropout_p == 0`` as deterministic;
* the copy carried the joint's ``MUST_SAVE`` and the forward node's ``ap_must_save`` (shared
  ``custom`` dict), so SaveAll saved its output: the forward ran SDPA twice and kept a tensor
  the first partition never kept. ap-tags now drops those tags on a backward graph's
  recomputed forward ops.

No process group, no codegen: identity compilers, CPU, seconds.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from typing import Any

import ap_tags
import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from ap_partitioner import PartitionReport, SaveAllPartitioner, _compat, report_for

SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
STAGE_GIB = 5e-6  # small enough that AC stages put SDPA in a recomputed region


class Attention(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (
            t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
            for t in self.qkv(x).chunk(3, dim=-1)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(a.transpose(1, 2).reshape(b, s, d))


class Model(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Attention() for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


class FirstCompiled(nn.Module):
    def __init__(self, model: nn.Module, fn: Callable[..., Any], order: list[str]) -> None:
        super().__init__()
        self.model, self.fn, self.order = model, fn, order

    def forward(self, x: torch.Tensor) -> Any:
        params = dict(self.model.named_parameters())
        return self.fn(*[params[n] for n in self.order], x)


def _boxed_identity(gm: fx.GraphModule, _example_inputs: Any) -> Any:
    from functorch.compile import make_boxed_func

    return make_boxed_func(gm)


def first_compile(model: nn.Module, x: torch.Tensor) -> tuple[nn.Module, PartitionReport, Any]:
    """Export, AC-stage and ``default_partition`` the joint; tag the forward for the replay."""
    from torch._functorch.aot_autograd import (
        aot_compile_joint_with_descriptors,
        aot_export_joint_with_descriptors,
    )
    from torch._functorch.partitioners import default_partition

    seen: dict[str, Any] = {}

    def partition(gm: fx.GraphModule, joint_inputs: Any, **kw: Any) -> Any:
        kw.pop("compiler", None)
        fw, bw = default_partition(gm, joint_inputs, **kw)
        seen["report"] = report_for(fw, bw, kw["num_fwd_outputs"], partitioner="first")
        seen["bw"] = bw
        return fw, bw

    with contextlib.ExitStack() as stack:
        jd = aot_export_joint_with_descriptors(stack, model, (x,))
        with torch._functorch.config.patch(joint_custom_pass=ap_tags.ac_joint_pass(STAGE_GIB)):
            fn = aot_compile_joint_with_descriptors(
                jd,
                partition_fn=partition,
                fw_compiler=ap_tags.preserve_meta_compiler(tag_forward=True),
                bw_compiler=ap_tags.preserve_meta_compiler(),
            )
        order = list(jd.params_spec)
    return FirstCompiled(model, fn, order), seen["report"], seen["bw"]


def second_compile(first: nn.Module, x: torch.Tensor) -> tuple[PartitionReport, fx.GraphModule]:
    from torch._functorch.aot_autograd import aot_module_simplified

    reports: list[PartitionReport] = []
    graphs: list[fx.GraphModule] = []
    partitioner = SaveAllPartitioner(strict=True, on_report=reports.append)

    def capture(gm: fx.GraphModule, joint_inputs: Any, **kw: Any) -> Any:
        fw, bw = partitioner(gm, joint_inputs, **kw)
        graphs.append(fw)
        return fw, bw

    def backend(gm: fx.GraphModule, example_inputs: Any) -> Any:
        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=_boxed_identity,
            bw_compiler=_boxed_identity,
            partition_fn=capture,
        )

    torch._dynamo.reset()
    try:
        torch.compile(first, backend=backend, fullgraph=True)(x).backward()
    finally:
        torch._dynamo.reset()
    assert len(reports) == 1 and len(graphs) == 1
    return reports[0], graphs[0]


def _activation_signatures(fw: fx.GraphModule, report: PartitionReport) -> Counter[Any]:
    by_name = {n.name: n for n in fw.graph.nodes}
    sigs: Counter[Any] = Counter()
    for name in report.saved_names:
        node = by_name[name]
        val = node.meta.get("val")
        if node.op != "placeholder" and isinstance(val, torch.Tensor):
            sigs[(tuple(val.shape), val.dtype)] += 1
    return sigs


def _count(gm: fx.GraphModule, target: Any) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


@pytest.fixture(scope="module")
def two_stage() -> dict[str, Any]:
    torch.manual_seed(0)
    model, x = Model(), torch.randn(2, 8, 32)
    first, first_report, first_bw = first_compile(model, x)
    report, fw = second_compile(first, x)
    return {"first": first_report, "first_bw": first_bw, "report": report, "fw": fw}


def test_first_backward_recomputes_sdpa(two_stage: dict[str, Any]) -> None:
    """The scenario this file guards: the first partition recomputed SDPA in its backward."""
    assert _count(two_stage["first_bw"], SDPA) > 0


def test_save_all_replays_the_first_saved_set_with_sdpa(two_stage: dict[str, Any]) -> None:
    first: PartitionReport = two_stage["first"]
    report: PartitionReport = two_stage["report"]
    assert not report.fell_back, report.fallback_reason
    assert report.saved_activation_count == first.saved_activation_count
    assert report.saved_activation_bytes == first.saved_activation_bytes


def test_forward_runs_each_sdpa_once(two_stage: dict[str, Any]) -> None:
    """Saving the backward copy's output would make the forward compute it too."""
    assert _count(two_stage["fw"], SDPA) == len(Model().layers)


def _sdpa_node(*extra: Any, **kwargs: Any) -> fx.Node:
    g = fx.Graph()
    q = g.placeholder("q")
    return g.call_function(SDPA, (q, q, q, *extra), kwargs)


@pytest.mark.parametrize(
    ("extra", "kwargs", "random"),
    [
        ((), {}, False),
        ((0.0,), {}, False),
        ((), {"dropout_p": 0.0}, False),
        ((0.1,), {}, True),
        ((), {"dropout_p": 0.1}, True),
    ],
    ids=["default", "zero_pos", "zero_kw", "dropout_pos", "dropout_kw"],
)
def test_sdpa_is_random_only_with_dropout(
    extra: tuple[Any, ...], kwargs: dict[str, Any], random: bool
) -> None:
    assert _compat.is_random(_sdpa_node(*extra, **kwargs)) is random


def test_dropout_and_rand_stay_random() -> None:
    g = fx.Graph()
    a = g.placeholder("a")
    assert _compat.is_random(g.call_function(torch.ops.aten.native_dropout.default, (a, 0.5, True)))
    assert _compat.is_random(g.call_function(torch.ops.aten.rand_like.default, (a,)))
    assert not _compat.is_random(g.call_function(torch.ops.aten.mm.default, (a, a)))
