"""SaveAll saves a lossless widening cast's narrow source instead of the cast
(``ap_partitioner._narrow``).

The first partition (torch's ``default_partition``) saves what eager autograd saves; under bf16
that includes a norm's fp32 upcast of the bf16 residual stream. Replayed as is, Inductor stores
that upcast from the unrounded fp32 sum and never stores the bf16 value, so the forward's
residual stream runs unrounded (torchtitan Llama3 + SimpleFSDP bf16: loss gap 9.0e-5 against
stock Inductor's 2.4e-5). Saving the bf16 value instead gives the forward eager's rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ap_tags
import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from ap_partitioner import PartitionReport, SaveAllPartitioner, report_for
from ap_partitioner._narrow import lossless_widening, narrow_widening_casts
from ap_partitioner._rules import SavePlan
from ap_testing.two_stage import First, first_compile, second_compile
from torch.utils.checkpoint import CheckpointPolicy

aten = torch.ops.aten
prims = torch.ops.prims
BF16, F32 = torch.bfloat16, torch.float32


# --------------------------------------------------------------------- the dtype rule


@pytest.mark.parametrize(
    ("src", "dst", "widens"),
    [
        (torch.bfloat16, torch.float32, True),
        (torch.float16, torch.float32, True),
        (torch.bfloat16, torch.float64, True),
        (torch.float32, torch.float64, True),
        (torch.bfloat16, torch.float16, False),  # fewer exponent bits: not lossless
        (torch.float16, torch.bfloat16, False),  # fewer mantissa bits
        (torch.float32, torch.bfloat16, False),  # a downcast rounds
        (torch.float32, torch.float32, False),
        (torch.int32, torch.float64, False),  # not a floating cast
    ],
)
def test_lossless_widening(src: torch.dtype, dst: torch.dtype, widens: bool) -> None:
    assert lossless_widening(src, dst) is widens


# --------------------------------------------------------------------- hand-built joints


def _val(node: fx.Node, value: torch.Tensor) -> fx.Node:
    node.meta["val"] = value
    return node


def _call(g: fx.Graph, target: Any, *args: Any, name: str) -> fx.Node:
    node = g.call_function(target, args)
    node.name = name

    def val(a: Any) -> Any:
        return a.meta["val"] if isinstance(a, fx.Node) else a

    return _val(node, target(*[val(a) for a in args]))


def _replay(node: fx.Node) -> None:
    node.meta.setdefault("custom", {})[ap_tags.MUST_SAVE] = True


def _upcast_joint() -> fx.GraphModule:
    """fwd: ``add = a + b`` (bf16), ``up = add.float()`` (the first partition's save),
    ``sum(up)``; bwd: ``up * tangents_1``."""
    g = fx.Graph()
    a = _val(g.placeholder("primals_1"), torch.randn(8, 4, dtype=BF16))
    b = _val(g.placeholder("primals_2"), torch.randn(8, 4, dtype=BF16))
    t = _val(g.placeholder("tangents_1"), torch.randn(8, 4))
    add = _call(g, aten.add.Tensor, a, b, name="add")
    up = _call(g, prims.convert_element_type.default, add, F32, name="up")
    _replay(up)
    out = _call(g, aten.sum.default, up, name="sum_1")
    grad = _call(g, aten.mul.Tensor, up, t, name="grad")
    node = g.output((out, grad, None))
    node.meta["desc"] = [None] * 3
    return fx.GraphModule(nn.Module(), g)


def _saved(fw: fx.GraphModule, num_fwd_outputs: int = 1) -> list[str]:
    out = fw.graph.find_nodes(op="output")[0]
    return [n.name for n in out.args[0][num_fwd_outputs:] if isinstance(n, fx.Node)]


def test_replayed_upcast_is_saved_as_its_bf16_source() -> None:
    reports: list[PartitionReport] = []
    fw, bw = SaveAllPartitioner(strict=True, on_report=reports.append)(
        _upcast_joint(), [], num_fwd_outputs=1
    )
    (rep,) = reports
    assert "add" in _saved(fw) and "up" not in _saved(fw)
    casts = bw.graph.find_nodes(op="call_function", target=prims.convert_element_type.default)
    assert [c.args[0].name for c in casts] == ["add"]  # the backward widens the saved bf16
    assert rep.saved_activation_bytes == 8 * 4 * 2  # bf16, not the fp32 upcast's 128 bytes
    assert rep.narrowed_first_saves == ("up",) and rep.narrowed_storages == ("add",)
    assert any("up -> add" in note for note in rep.notes)


def test_a_source_saved_anyway_adds_no_storage() -> None:
    g = fx.Graph()
    add = _add(g, 4)
    up = _call(g, prims.convert_element_type.default, add, F32, name="up")
    plan, narrowed = narrow_widening_casts(SavePlan([add, up]))
    assert [v.name for v in plan.values] == ["add"]
    assert [(n.cast.name, n.source.name, n.new_storage) for n in narrowed] == [("up", "add", False)]


def _plan(make: Callable[[fx.Graph], list[fx.Node]]) -> tuple[list[str], list[str]]:
    """Names saved after narrowing ``make``'s plan, and the narrowed casts."""
    g = fx.Graph()
    values = make(g)
    plan, narrowed = narrow_widening_casts(SavePlan(values))
    return [v.name for v in plan.values], [n.cast.name for n in narrowed]


def _add(g: fx.Graph, *shape: int) -> fx.Node:
    a = _val(g.placeholder("a"), torch.randn(*shape, dtype=BF16))
    return _call(g, aten.add.Tensor, a, a, name="add")


def test_narrowing_keeps_a_cast_it_cannot_narrow_for_free() -> None:
    # a graph input's upcast: inputs are already rounded, and saving them is the caller's
    def of_input(g: fx.Graph) -> list[fx.Node]:
        a = _val(g.placeholder("a"), torch.randn(4, dtype=BF16))
        return [_call(g, prims.convert_element_type.default, a, F32, name="up")]

    assert _plan(of_input) == (["up"], [])

    # a downcast rounds: saving its source would change what the backward reads
    def downcast(g: fx.Graph) -> list[fx.Node]:
        a = _val(g.placeholder("a"), torch.randn(4))
        x = _call(g, aten.neg.default, a, name="x")
        return [_call(g, prims.convert_element_type.default, x, BF16, name="down")]

    assert _plan(downcast) == (["down"], [])

    # a cast of a view (here a slice of a larger storage): saving the view keeps its base
    # alive, and Inductor rounds a saved value for its kernel's consumers only when it is the
    # saved output itself
    def of_slice(g: fx.Graph) -> list[fx.Node]:
        big = _add(g, 64)
        part = _call(g, aten.slice.Tensor, big, 0, 0, 4, name="part")
        return [_call(g, prims.convert_element_type.default, part, F32, name="up")]

    assert _plan(of_slice) == (["up"], [])

    # a cast of a cast (``.to(bf16)`` then ``.float()``): Inductor's rounding of saved outputs
    # does not cover explicit casts, so the forward would read the unrounded value and the
    # backward the rounded one
    def of_downcast(g: fx.Graph) -> list[fx.Node]:
        a = _val(g.placeholder("a"), torch.randn(4))
        x = _call(g, aten.neg.default, a, name="x")
        down = _call(g, prims.convert_element_type.default, x, BF16, name="down")
        return [_call(g, prims.convert_element_type.default, down, F32, name="up")]

    assert _plan(of_downcast) == (["up"], [])

    # a source the first compilation said to recompute (an FSDP re-gather) is never saved
    def recomputed_source(g: fx.Graph) -> list[fx.Node]:
        add = _add(g, 4)
        add.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        return [_call(g, prims.convert_element_type.default, add, F32, name="up")]

    assert _plan(recomputed_source) == (["up"], [])

    # a cast a checkpoint policy pinned is saved as the policy says
    def pinned(g: fx.Graph) -> list[fx.Node]:
        up = _call(g, prims.convert_element_type.default, _add(g, 4), F32, name="up")
        up.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        return [up]

    assert _plan(pinned) == (["up"], [])

    # a saved view of the cast would keep the cast's storage alive next to the source
    def viewed(g: fx.Graph) -> list[fx.Node]:
        up = _call(g, prims.convert_element_type.default, _add(g, 4), F32, name="up")
        return [up, _call(g, aten.view.default, up, [2, 2], name="v")]

    assert _plan(viewed) == (["up", "v"], [])


# --------------------------------------------------------------------- two compilations


class Block(nn.Module):
    """RMSNorm (fp32 inside, as torchtitan's) and a residual add on a pointwise branch."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = nn.Linear(dim, dim, bias=False)
        self.g = nn.Parameter(torch.ones(dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        return h + torch.tanh(self.w(x.type_as(h) * self.g))


class Model(nn.Module):
    def __init__(self, dim: int = 64, layers: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        return h.float().pow(2).mean()


@pytest.fixture(scope="module")
def bf16_first() -> tuple[Model, First]:
    torch.manual_seed(0)
    model = Model().to(BF16)
    x = torch.randn(32, 64, dtype=BF16)
    return model, first_compile(model, x)


def test_replay_saves_the_residual_stream_in_bf16(bf16_first: tuple[Model, First]) -> None:
    """The first partition saves the fp32 upcast of every ``h`` a norm (or the loss) widens;
    the replay saves ``h`` itself (bf16) wherever ``h`` is a residual add: no more storages,
    fewer bytes, and the report names the narrowed first-partition saves."""
    _, first = bf16_first
    out = first.fw.graph.find_nodes(op="output")[0].args[0][first.num_fwd_outputs :]
    upcasts_of_adds = [
        n.name
        for n in out
        if n.target is aten._to_copy.default
        and n.meta["val"].dtype == F32
        and n.args[0].target is aten.add.Tensor
    ]
    before = report_for(first.fw, first.bw, first.num_fwd_outputs)
    reports: list[PartitionReport] = []
    torch._dynamo.reset()
    (fw,) = second_compile(first, SaveAllPartitioner(strict=True, on_report=reports.append))
    (rep,) = reports
    assert len(upcasts_of_adds) == 3  # two blocks' norms and the loss widen a residual add
    assert sorted(rep.narrowed_first_saves) == sorted(upcasts_of_adds)
    saved = {n.name: n for n in fw.graph.nodes if n.name in _saved(fw)}
    assert len(rep.narrowed_storages) == 3
    for name in rep.narrowed_storages:
        assert saved[name].meta["val"].dtype == BF16 and saved[name].target is aten.add.Tensor
    assert rep.saved_activation_count <= before.saved_activation_count
    # three fp32 (32, 64) upcasts became bf16
    assert rep.saved_activation_bytes == before.saved_activation_bytes - 3 * 32 * 64 * 2


@pytest.mark.slow
@pytest.mark.xfail(
    str(torch.__version__).startswith(("2.11.", "2.12.")),
    reason="torch 2.11.0 / 2.12.1 (matrix, 2026-11-26): replayed 1.603633 vs stock Inductor "
    "1.603695 on 2.11 (3.9e-5 relative, bar 1e-6; eager 1.604073), replayed 1.634038 vs stock "
    "1.633519 on 2.12 (3.2e-4; eager 1.633837, so the replay is the closer of the two there): "
    "those Inductors round the two bf16 forwards differently; not investigated (issue #33)",
    strict=False,
)
def test_inductor_forward_rounds_the_residual_stream_as_stock(
    bf16_first: tuple[Model, First],
) -> None:
    """With Inductor, the replayed forward's loss is stock Inductor's (min-cut) to 1e-6; saving
    the fp32 upcasts it was 2.5e-4 away (and 1.3x stock's gap to eager)."""
    model, first = bf16_first
    x = first.x
    reports: list[PartitionReport] = []
    torch._dynamo.reset()
    partitioner = SaveAllPartitioner(strict=True, on_report=reports.append)
    with torch._inductor.config.patch(custom_partitioner_fn=partitioner):
        compiled = torch.compile(first.module, backend="inductor", fullgraph=True)
        replayed = float(compiled(x).detach())
    torch._dynamo.reset()
    stock = float(torch.compile(model, backend="inductor", fullgraph=True)(x))
    torch._dynamo.reset()
    assert abs(replayed - stock) <= 1e-6 * abs(stock), (replayed, stock, float(model(x)))
    assert reports and reports[0].narrowed_first_saves
