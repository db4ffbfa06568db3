"""What the replay saves fewer, named against the first forward graph (``_unread_saves``).

Each case pairs a first-partition forward graph (registered as ``preserve_meta_compiler``
registers it, with AOTAutograd's output descriptors) with a hand-built retrace of it in the
shape torch 2.15 produces (checked on HF Phi-3 and timm/torchvision ResNets): provenance
``from_node`` points at the first graph's nodes, backward nodes are marked and inherit tags.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from ap_tags import MUST_SAVE, MUST_SAVE_INDICES, TAG_SCHEMA, TAG_SCHEMA_VERSION, replayed_saves
from ap_tags._first_forward import register_first_forward
from torch._functorch._aot_autograd.descriptors import (
    BufferAOTInput,
    InputMutationAOTOutput,
    PlainAOTOutput,
    SavedForBackwardsAOTOutput,
)
from torch.fx.traceback import NodeSource, NodeSourceAction

aten = torch.ops.aten
SAVED = {MUST_SAVE: True, TAG_SCHEMA: TAG_SCHEMA_VERSION}


def _first(
    build: Any, user: int, saved: int, written: tuple[str, ...] = ()
) -> dict[str, torch.fx.Node]:
    """A first forward graph: ``build(g)`` returns its nodes by name and its output list
    ``[written-back..., user..., saved...]``; descriptors say which is which."""
    g = torch.fx.Graph()
    nodes, outs = build(g)
    out = g.output(tuple(outs))
    out.meta["desc"] = [
        *(InputMutationAOTOutput(BufferAOTInput(t)) for t in written),
        *(PlainAOTOutput(i) for i in range(user)),
        *(SavedForBackwardsAOTOutput(i) for i in range(saved)),
    ]
    register_first_forward(g)
    nodes["graph"] = g
    return nodes  # type: ignore[no-any-return]


def _call(g: torch.fx.Graph, name: str, target: Any, *args: Any) -> torch.fx.Node:
    return g.create_node("call_function", target, args, name=name)


class Retrace:
    def __init__(self) -> None:
        self.g = torch.fx.Graph()

    def ph(self, name: str) -> torch.fx.Node:
        node = self.g.placeholder(name)
        node.meta["val"] = torch.empty(4, 8)
        return node

    def fwd(
        self, source: torch.fx.Node | None, target: Any, *args: Any, tag: Any = None
    ) -> torch.fx.Node:
        node = self.g.call_function(target, args)
        node.meta["val"] = torch.empty(4, 8)
        if tag is not None:
            node.meta["custom"] = dict(tag)
        if source is not None:
            node.meta["from_node"] = [NodeSource(source, "Interpreter_X", NodeSourceAction.CREATE)]
        return node

    def bwd(self, target: Any, *args: Any) -> torch.fx.Node:
        node = self.fwd(None, target, *args, tag=SAVED)
        node.meta["autograd_backward"] = True
        return node


# ------------------------------------------------------------------------------------------
# a saved copy the retrace traces to no node (HF Phi-3's contiguous attention output)


def _attention_first(g: torch.fx.Graph) -> tuple[dict[str, torch.fx.Node], list[Any]]:
    """``a = relu(x)`` (the attention output), ``clone(transpose(a))`` its contiguous copy,
    saved as a view: the first partition keeps two storages, ``a`` and ``clone``."""
    x = g.placeholder("x")
    a = _call(g, "a", aten.relu.default, x)
    t = _call(g, "t", aten.transpose.int, a, 0, 1)
    c = _call(g, "clone", aten.clone.default, t)
    v = _call(g, "v", aten.view.default, c, [32])
    mm = _call(g, "mm", aten.sum.default, v)
    return {"a": a, "t": t, "clone": c, "v": v, "mm": mm}, [mm, a, v]


def _attention_retrace(
    first: dict[str, torch.fx.Node], with_clone: bool, backward_reads_a: bool = True
) -> Retrace:
    r = Retrace()
    x = r.ph("primals_1")
    tangent = r.ph("tangents_1")
    a = r.fwd(first["a"], aten.relu.default, x, tag=SAVED)
    t = r.fwd(first["t"], aten.permute.default, a, [1, 0])
    if with_clone:
        t = r.fwd(first["clone"], aten.clone.default, t)
    v = r.fwd(first["v"], aten.view.default, t, [32], tag=SAVED)
    mm = r.fwd(first["mm"], aten.sum.default, v)
    back = r.bwd(aten.mul.Tensor, tangent, v if backward_reads_a else mm)
    back2 = r.bwd(aten.mul.Tensor, back, a) if backward_reads_a else back
    r.g.output((mm, back2))
    return r


def test_a_saved_copy_with_no_retraced_node_is_named_with_its_source() -> None:
    """The retrace reads the attention output ``a`` through a view; ``clone`` has no node, so
    its storage is one the replay cannot keep: named, and why."""
    first = _first(_attention_first, user=1, saved=2)
    resolved = replayed_saves(_attention_retrace(first, with_clone=False).g)
    assert resolved.dropped == ("clone",)
    (why,) = resolved.dropped_why
    assert "no node in the retrace" in why and "a copy of t (storage a)" in why
    assert any("clone (no node in the retrace" in line for line in resolved.notes())


def test_a_saved_copy_the_retrace_still_computes_is_not_named() -> None:
    first = _first(_attention_first, user=1, saved=2)
    resolved = replayed_saves(_attention_retrace(first, with_clone=True).g)
    assert resolved.dropped == ()


def test_a_copy_is_named_only_when_the_replay_keeps_its_source() -> None:
    """No node from ``clone``, but the backward reads neither ``a`` nor a view of it: the
    copy was not redundant with anything the replay keeps, so no reason holds -- unnamed."""
    first = _first(_attention_first, user=1, saved=2)
    retrace = _attention_retrace(first, with_clone=False, backward_reads_a=False)
    assert "clone" not in replayed_saves(retrace.g).dropped


def _copy_only_first(g: torch.fx.Graph) -> tuple[dict[str, torch.fx.Node], list[Any]]:
    """As :func:`_attention_first`, but the first partition saves only the copy (a view of
    ``clone``), not ``a``: the copy stands *instead of* its source (HF Mixtral's ``clone`` of
    the router's ``topk`` weights)."""
    nodes, outs = _attention_first(g)
    return nodes, [outs[0], outs[2]]


def test_a_copy_saved_instead_of_its_source_is_not_named() -> None:
    """The replay reads ``a`` where the first partition saved ``clone``: one storage of the
    same size each, nothing dropped -- naming ``clone`` would misreport an exact replay (seen
    on HF Mixtral at 2 gloo ranks: "replay differs from first" with 65 = 65 storages)."""
    first = _first(_copy_only_first, user=1, saved=1)
    assert replayed_saves(_attention_retrace(first, with_clone=False).g).dropped == ()


def test_nothing_is_named_from_a_first_graph_never_registered() -> None:
    """Without the first forward graph the absence of a node proves nothing: no names."""
    g = torch.fx.Graph()
    nodes, outs = _attention_first(g)
    out = g.output(tuple(outs))
    out.meta["desc"] = [PlainAOTOutput(0), *(SavedForBackwardsAOTOutput(i) for i in range(2))]
    resolved = replayed_saves(_attention_retrace(nodes, with_clone=False).g)
    assert resolved.dropped == ()


# ------------------------------------------------------------------------------------------
# batch norm's running statistics: saved outputs 3 and 4, written back, never read


def _batch_norm_first(g: torch.fx.Graph) -> tuple[dict[str, torch.fx.Node], list[Any]]:
    x, w, b, rm, rv = (g.placeholder(n) for n in ("x", "w", "b", "rm", "rv"))
    op = aten._native_batch_norm_legit_functional.default
    bn = _call(g, "bn", op, x, w, b, rm, rv, True, 0.1, 1e-5)
    outs = [_call(g, f"getitem_{i}", operator.getitem, bn, i) for i in range(5)]
    relu = _call(g, "relu", aten.relu.default, outs[0])
    nodes = {"bn": bn, "relu": relu}
    return nodes, [outs[3], outs[4], relu, outs[1], outs[2], outs[3], outs[4]]


def _batch_norm_retrace(
    first: dict[str, torch.fx.Node], read_running_mean: bool, rv_through_alias: bool = False
) -> Retrace:
    """The retrace decomposes the op: every node of it names ``bn``; the running statistics'
    new values are ``copy_``-ed into the buffers; the backward reads mean and invstd."""
    r = Retrace()
    x, rm, rv = r.ph("primals_1"), r.ph("primals_2"), r.ph("primals_3")
    tangent = r.ph("tangents_1")
    tag = {**SAVED, MUST_SAVE_INDICES: [1, 2, 3, 4]}
    bn = first["bn"]
    mean = r.fwd(bn, aten.mean.dim, x, [0], tag=tag)
    invstd = r.fwd(bn, aten.rsqrt.default, mean, tag=tag)
    out = r.fwd(bn, aten.mul.Tensor, x, invstd, tag=tag)
    new_rm = r.fwd(bn, aten.add.Tensor, mean, rm, tag=tag)
    new_rv = r.fwd(bn, aten.add.Tensor, invstd, rv, tag=tag)
    relu = r.fwd(first["relu"], aten.relu.default, out)
    back = r.bwd(aten.mul.Tensor, tangent, invstd)
    back = r.bwd(aten.sub.Tensor, back, new_rm if read_running_mean else mean)
    r.fwd(None, aten.copy_.default, rm, new_rm)
    if rv_through_alias:  # written back through a node of no provenance; the backward reads it
        back = r.bwd(aten.sub.Tensor, back, new_rv)
        new_rv = r.fwd(None, aten.alias.default, new_rv)
    r.fwd(None, aten.copy_.default, rv, new_rv)
    r.g.output((relu, back))
    return r


def test_batch_norm_running_statistics_are_named_output_precisely() -> None:
    """The first partition saved outputs 1-4; the retrace reads mean and invstd only. The two
    values it writes back to the buffers are the op's written-back outputs (3 and 4), read by
    no backward node: named ``bn[3]``, ``bn[4]``, with the buffer each updates."""
    first = _first(_batch_norm_first, user=1, saved=4, written=("rm", "rv"))
    resolved = replayed_saves(_batch_norm_retrace(first, read_running_mean=False).g)
    assert resolved.dropped == ("bn[3]", "bn[4]")
    assert resolved.dropped_why[0].startswith("written back, never read:")
    assert "rm" in resolved.dropped_why[0]
    assert "rv" in resolved.dropped_why[1]


def test_batch_norm_running_statistics_the_backward_reads_are_not_named() -> None:
    """One written-back value read by the backward: which saved output is which is unknown,
    so nothing is named rather than guessed."""
    first = _first(_batch_norm_first, user=1, saved=4, written=("rm", "rv"))
    resolved = replayed_saves(_batch_norm_retrace(first, read_running_mean=True).g)
    assert resolved.dropped == ()


def test_write_backs_are_named_only_when_each_has_its_retraced_value() -> None:
    """The running variance reaches its buffer through a node of no provenance, and the
    backward reads it: only one of the op's two written-back outputs is seen written back,
    so which saved output that is cannot be told -- nothing is named."""
    first = _first(_batch_norm_first, user=1, saved=4, written=("rm", "rv"))
    retrace = _batch_norm_retrace(first, read_running_mean=False, rv_through_alias=True)
    assert replayed_saves(retrace.g).dropped == ()
