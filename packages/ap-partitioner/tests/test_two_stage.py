"""Two-stage compile on an FSDP-style transformer (fake process group, world size 8, CPU).

First compilation: export the joint graph, tag FSDP all-gather chains MUST_RECOMPUTE, partition
with torch's ``default_partition``, interpret with ``preserve_meta_compiler(tag_forward=True)``.
Second compilation: ``torch.compile`` of the first compilation's callable, capturing the
partition with ``aot_module_simplified`` and identity compilers (no codegen). The fake process
group's data is garbage: these tests check structure only, never numbers.
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import ap_tags
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from ap_partitioner import MinCutPartitioner, PartitionReport, SaveAllPartitioner, report_for
from ap_partitioner._report import is_all_gather_output
from torch.testing._internal.distributed.fake_pg import FakeStore

WORLD = 8
ORIGIN = "test_origin"  # custom key: the first forward node a second-graph node was traced from


# ----------------------------------------------------------------------------- the model


def _gather(weight: torch.Tensor) -> torch.Tensor:
    """Autograd-aware functional all-gather along dim 0 (its backward is a reduce-scatter)."""
    fn = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return fn(weight, 0, dist.group.WORLD)  # type: ignore[no-any-return]


class ShardedLinear(nn.Module):
    """Holds a dim-0 shard of the weight; gathers (optionally cast to bf16) in forward."""

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
        self.w1 = ShardedLinear(dim, 2 * dim, cast)
        self.w2 = ShardedLinear(2 * dim, dim, cast)

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
        self,
        layers: int = 2,
        dim: int = 64,
        heads: int = 4,
        cast: torch.dtype | None = torch.bfloat16,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dim, heads, cast) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


# ----------------------------------------------------------------------------- two stages


@dataclass
class First:
    module: nn.Module  # calls the first compilation's callable with the sharded params
    x: torch.Tensor
    fw: fx.GraphModule  # the first forward graph (tagged)
    report: PartitionReport


class FirstCompiled(nn.Module):
    def __init__(self, model: nn.Module, fn: Callable[..., Any], order: list[str]) -> None:
        super().__init__()
        self.model, self.fn, self.order = model, fn, order

    def forward(self, x: torch.Tensor) -> Any:
        params = dict(self.model.named_parameters())
        return self.fn(*[params[n] for n in self.order], x)


def first_compile(model: nn.Module, x: torch.Tensor) -> First:
    from torch._functorch.aot_autograd import (
        aot_compile_joint_with_descriptors,
        aot_export_joint_with_descriptors,
    )
    from torch._functorch.partitioners import default_partition

    seen: dict[str, Any] = {}

    def partition(gm: fx.GraphModule, joint_inputs: Any, **kw: Any) -> Any:
        fw, bw = default_partition(gm, joint_inputs, **kw)
        seen["report"] = report_for(fw, bw, kw["num_fwd_outputs"], partitioner="first")
        return fw, bw

    def fw_compiler(gm: fx.GraphModule, example_inputs: Any) -> Any:
        for node in gm.graph.nodes:  # provenance for the comparison (own dict per node)
            node.meta["custom"] = {**(node.meta.get("custom") or {}), ORIGIN: node.name}
        seen["fw"] = gm
        return ap_tags.preserve_meta_compiler(tag_forward=True)(gm, example_inputs)

    with contextlib.ExitStack() as stack:
        jd = aot_export_joint_with_descriptors(stack, model, (x,))
        tagged = ap_tags.mark_fsdp_all_gather_recomputation(jd.graph_module.graph)
        assert tagged.chains_found == 6 * len(model.layers)  # type: ignore[arg-type]
        fn = aot_compile_joint_with_descriptors(
            jd,
            partition_fn=partition,
            fw_compiler=fw_compiler,
            bw_compiler=ap_tags.preserve_meta_compiler(),
        )
        order = list(jd.params_spec)
    return First(FirstCompiled(model, fn, order), x, seen["fw"], seen["report"])


def _boxed_identity(gm: fx.GraphModule, _example_inputs: Any) -> Any:
    from functorch.compile import make_boxed_func

    return make_boxed_func(gm)


def second_compile(
    first: First, partitioner: Any, *, ac: bool
) -> tuple[PartitionReport, fx.GraphModule]:
    """``torch.compile`` the first callable; return the partition report and forward graph."""
    from torch._functorch.aot_autograd import aot_module_simplified

    reports: list[PartitionReport] = []
    graphs: list[fx.GraphModule] = []

    def capture(gm: fx.GraphModule, joint_inputs: Any, **kw: Any) -> Any:
        fw, bw = partitioner(gm, joint_inputs, **kw)
        graphs.append(fw)
        return fw, bw

    partitioner.on_report = reports.append

    def backend(gm: fx.GraphModule, example_inputs: Any) -> Any:
        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=_boxed_identity,
            bw_compiler=_boxed_identity,
            partition_fn=capture,
        )

    torch._dynamo.reset()
    joint_pass = ap_tags.ac_joint_pass("auto") if ac else None
    with torch._functorch.config.patch(joint_custom_pass=joint_pass):
        loss = torch.compile(first.module, backend=backend, fullgraph=True)(first.x)
    loss.backward()
    assert len(reports) == 1 and len(graphs) == 1
    return reports[0], graphs[0]


# ----------------------------------------------------------------------------- comparison


def _canonical_classes(fw: fx.GraphModule) -> dict[str, str]:
    """first-forward node name -> name of its CSE class representative.

    The replay runs torch's CSE, which merges structurally identical values (``y.view(...)``
    feeding q, k and v): those are one value, saved once. Comparing classes compares values.
    """
    rep: dict[fx.Node, str] = {}
    seen: dict[Any, str] = {}
    for node in fw.graph.nodes:
        if node.op != "call_function" or node.is_impure():
            rep[node] = node.name
            continue
        key = (
            node.target,
            repr(fx.node.map_arg(node.args, lambda a: rep[a])),
            repr(fx.node.map_arg(node.kwargs, lambda a: rep[a])),
        )
        rep[node] = seen.setdefault(key, node.name)
    return {n.name: r for n, r in rep.items()}


def _origin(node: fx.Node) -> str | None:
    custom = node.meta.get("custom") or {}
    return custom.get(ORIGIN)


def _saved_activations(fw: fx.GraphModule, names: tuple[str, ...]) -> list[fx.Node]:
    by_name = {n.name: n for n in fw.graph.nodes}
    return [by_name[n] for n in names if by_name[n].op != "placeholder"]


def first_saved_classes(first: First) -> list[str]:
    classes = _canonical_classes(first.fw)
    acts = _saved_activations(first.fw, first.report.saved_names)
    return sorted({classes[n.name] for n in acts})


def replayed_classes(first: First, fw: fx.GraphModule, report: PartitionReport) -> list[str]:
    """Map each saved value of a second partition back to the first forward node it came from.

    A getitem created by a retrace inherits its parent's meta, so it maps to the first graph's
    getitem of the same index under that parent.
    """
    classes = _canonical_classes(first.fw)
    first_nodes = {n.name: n for n in first.fw.graph.nodes}
    out: list[str] = []
    for node in _saved_activations(fw, report.saved_names):
        origin = _origin(node)
        if origin is None:
            out.append(f"<untagged {node.name}>")
            continue
        src = first_nodes[origin]
        if node.target is operator.getitem and src.target is not operator.getitem:
            src = next(
                u for u in src.users if u.target is operator.getitem and u.args[1] == node.args[1]
            )
        out.append(classes[src.name])
    return sorted(out)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def fake_pg() -> Iterator[None]:
    dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def first(fake_pg: None) -> First:
    torch.manual_seed(0)
    return first_compile(Transformer(layers=2), torch.randn(2, 16, 64))


_cache: dict[tuple[str, bool], tuple[PartitionReport, fx.GraphModule]] = {}


@pytest.fixture(scope="module")
def run(first: First) -> Callable[[str, bool], tuple[PartitionReport, fx.GraphModule]]:
    def get(which: str, ac: bool) -> tuple[PartitionReport, fx.GraphModule]:
        if (which, ac) not in _cache:
            part = SaveAllPartitioner(strict=True) if which == "save_all" else MinCutPartitioner()
            _cache[(which, ac)] = second_compile(first, part, ac=ac)
        return _cache[(which, ac)]

    _cache.clear()
    return get


# ----------------------------------------------------------------------------- tests


def test_first_partition_saves_no_all_gather_outputs(first: First) -> None:
    assert first.report.saved_activation_count > 0
    assert first.report.saved_all_gather_count == 0
    assert first.report.backward_all_gathers > 0  # the backward re-gathers the weights


@pytest.mark.parametrize("ac", [False, True], ids=["no_ac", "ac"])
def test_save_all_replays_the_first_saved_set(first: First, run: Any, ac: bool) -> None:
    report, fw = run("save_all", ac)
    assert not report.fell_back
    expected = first_saved_classes(first)
    got = replayed_classes(first, fw, report)
    assert got == expected  # same values, each saved once


def test_save_all_saves_no_all_gather_or_wait_output(run: Any) -> None:
    report, fw = run("save_all", True)
    assert report.saved_all_gather_count == 0 and report.saved_all_gather_bytes == 0
    by_name = {n.name: n for n in fw.graph.nodes}
    for name in report.saved_names:
        assert not is_all_gather_output(by_name[name]), name


def test_min_cut_with_ac_differs_from_the_replay(first: First, run: Any) -> None:
    save_all, sa_fw = run("save_all", True)
    min_cut, mc_fw = run("min_cut", True)
    assert replayed_classes(first, mc_fw, min_cut) != replayed_classes(first, sa_fw, save_all)
    rows = {
        "first": first.report,
        "save_all+ac": save_all,
        "min_cut+ac": min_cut,
        "min_cut": run("min_cut", False)[0],
    }
    print("\npartition           saved_act  act_bytes  ag_saved  ag_bytes  bw_coll  bw_ag  time_ms")
    for name, r in rows.items():
        print(
            f"{name:<18} {r.saved_activation_count:>10} {r.saved_activation_bytes:>10} "
            f"{r.saved_all_gather_count:>9} {r.saved_all_gather_bytes:>9} "
            f"{r.backward_collectives:>8} {r.backward_all_gathers:>6} "
            f"{r.partition_time_s * 1e3:>8.1f}"
        )
    # the replay re-gathers exactly what the first backward re-gathered
    assert save_all.backward_all_gathers == first.report.backward_all_gathers
    assert save_all.backward_collectives == first.report.backward_collectives


def test_wait_dce_keeps_unused_cast_parameters_out_of_the_saved_set(first: First, run: Any) -> None:
    """Without ``wait_tensor_dce`` an unused re-gather in the backward (layer 0's q/k/v weights:
    the input needs no gradient) stays alive through its impure wait, so extraction hands the
    sharded parameter to the backward as a saved input with no users (reference notes §1.3)."""
    with_dce, _ = run("save_all", False)
    without, _ = second_compile(first, SaveAllPartitioner(dce_unused_waits=False), ac=False)
    extra = set(without.saved_names) - set(with_dce.saved_names)
    assert extra and all(name.startswith("primals_") for name in extra), extra
    assert without.saved_input_count == with_dce.saved_input_count + len(extra)
