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

from collections import Counter
from typing import Any

import ap_tags
import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from ap_partitioner import PartitionReport, SaveAllPartitioner, _compat, report_for
from ap_testing.two_stage import First, first_compile, second_compile

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


def _first(model: nn.Module, x: torch.Tensor) -> First:
    """The first compilation with AC staging (the joint pass runs at partition time)."""
    with torch._functorch.config.patch(joint_custom_pass=ap_tags.ac_joint_pass(STAGE_GIB)):
        return first_compile(model, x)


def _second(first: First) -> tuple[PartitionReport, fx.GraphModule]:
    reports: list[PartitionReport] = []
    graphs = second_compile(first, SaveAllPartitioner(strict=True, on_report=reports.append))
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
    first = _first(Model(), torch.randn(2, 8, 32))
    first_report = report_for(first.fw, first.bw, first.num_fwd_outputs, partitioner="first")
    report, fw = _second(first)
    return {"first": first_report, "first_bw": first.bw, "report": report, "fw": fw}


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
