"""The replay's in-place epilogue orders graphs exactly as torch's copying passes do.

``autograd_order_in_place`` / ``raise_getitems_in_place`` replace torch's
``reordering_to_mimic_autograd_engine`` / ``raise_getitems`` (a graph copy plus two code
generations) by node moves. Rule: same nodes, same order, same code -- checked against torch's
own passes on the backward graphs torch's extraction produces from random joints (FSDP chains
recomputed in the backward included), on a hand-built backward that exercises the ``copy_``
and dead-prefix cases, and by running the reordered backward.
"""

from __future__ import annotations

import copy

import torch
import torch._functorch.partitioners as torch_partitioners
import torch.fx as fx
from ap_partitioner._epilogue import autograd_order_in_place, raise_getitems_in_place
from ap_testing.joints import RandomJoint, random_joints, run
from hypothesis import assume, given, settings

aten = torch.ops.aten


def _code(gm: fx.GraphModule) -> str:
    return gm.graph.python_code("self").src


def _same_as_torch(bw: fx.GraphModule) -> fx.GraphModule:
    theirs = torch_partitioners.raise_getitems(
        torch_partitioners.reordering_to_mimic_autograd_engine(copy.deepcopy(bw))
    )
    ours = raise_getitems_in_place(autograd_order_in_place(copy.deepcopy(bw)))
    ours.graph.lint()
    assert [n.name for n in ours.graph.nodes] == [n.name for n in theirs.graph.nodes]
    assert _code(ours) == _code(theirs)
    return ours


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(random_joints(layout="joint"))
def test_matches_torch_on_extracted_backwards(joint: RandomJoint) -> None:
    try:  # random tags may make torch's extraction refuse the joint: nothing to compare then
        _, bw = torch_partitioners.default_partition(
            copy.deepcopy(joint.gm), joint.inputs, num_fwd_outputs=joint.num_fwd_outputs
        )
    except (AssertionError, RuntimeError):
        assume(False)
    ours = _same_as_torch(bw)
    if joint.executable:
        saved_and_tangents = [
            torch.randn(n.meta["val"].shape) if hasattr(n.meta.get("val"), "shape") else None
            for n in bw.graph.find_nodes(op="placeholder")
        ]
        for got, want in zip(
            run(ours, saved_and_tangents), run(bw, saved_and_tangents), strict=True
        ):
            torch.testing.assert_close(got, want)


def _hand_built() -> fx.GraphModule:
    """A backward whose prefix holds a ``copy_`` reading no tangent, a dead forward leftover
    and a recomputation only a late gradient needs; then two gradients."""
    g = fx.Graph()
    x = g.placeholder("primals_1")
    buf = g.placeholder("primals_2")
    t = g.placeholder("tangents_1")
    dead = g.call_function(aten.sin.default, (x,))
    dead.name = "dead_sin"
    cp = g.call_function(aten.copy_.default, (buf, x))
    late = g.call_function(aten.cos.default, (x,))
    early = g.call_function(aten.mul.Tensor, (t, x))
    grad2 = g.call_function(aten.mul.Tensor, (t, late))
    g.output((early, grad2, cp))
    return fx.GraphModule(torch.nn.Module(), g)


def test_matches_torch_on_copy_and_dead_prefix() -> None:
    ours = _same_as_torch(_hand_built())
    names = [n.name for n in ours.graph.nodes]
    assert "dead_sin" not in names  # dropped, as torch's copy drops it
    # the copy_ is placed before the first gradient, the recomputation just before its reader
    assert names.index("copy__default") < names.index("mul_tensor") < names.index("cos_default")


def test_no_tangent_reader_leaves_graph_unchanged() -> None:
    g = fx.Graph()
    x = g.placeholder("primals_1")
    g.placeholder("tangents_1")
    g.output((g.call_function(aten.sin.default, (x,)),))
    gm = fx.GraphModule(torch.nn.Module(), g)
    before = _code(gm)
    assert autograd_order_in_place(gm) is gm
    assert _code(gm) == before
