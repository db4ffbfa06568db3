"""replayed_saves: the first partition's save tags resolved by meaning on retraced joints.

Each graph is hand-built in the shape the second compilation's joint really has (checked on
torch 2.15 retraces of real models): every node traced from a tagged first-compile node carries
its ``custom`` (so a decomposed op's whole chain is tagged), backward nodes are marked
``autograd_backward`` and inherit the forward's tags through ``seq_nr``, and the retraced
backward reads exactly the values the first partition saved (sometimes through the ``detach``
AOTAutograd puts on a saved tensor).
"""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
import torch.fx
from ap_tags import (
    MUST_SAVE,
    MUST_SAVE_INDICES,
    TAG_SCHEMA,
    TAG_SCHEMA_VERSION,
    first_partition_name,
    replayed_saves,
)
from ap_tags.graph import backward_nodes

aten = torch.ops.aten
prims = torch.ops.prims

SAVED = {MUST_SAVE: True, TAG_SCHEMA: TAG_SCHEMA_VERSION}


class Retrace:
    """Builds a retraced joint: ``fwd(...)`` nodes carry the tag of the first-compile node they
    were traced from, ``bwd(...)`` nodes are marked backward and inherit a save tag."""

    def __init__(self) -> None:
        self.g = torch.fx.Graph()
        self.n: dict[str, torch.fx.Node] = {}

    def ph(self, name: str, *shape: int) -> torch.fx.Node:
        node = self.g.placeholder(name)
        node.meta["val"] = torch.empty(shape)
        self.n[name] = node
        return node

    def _op(self, name: str, target: Any, args: tuple[Any, ...], val: Any) -> torch.fx.Node:
        node = self.g.call_function(target, args)
        node.name = name
        node.meta["val"] = val
        self.n[name] = node
        return node

    def fwd(
        self, name: str, target: Any, *args: Any, tag: dict[str, Any] | None = None, val: Any = None
    ) -> torch.fx.Node:
        node = self._op(name, target, args, torch.empty(4, 8) if val is None else val)
        if tag is not None:
            node.meta["custom"] = dict(tag)
        return node

    def bwd(self, name: str, target: Any, *args: Any) -> torch.fx.Node:
        node = self._op(name, target, args, torch.empty(4, 8))
        node.meta["autograd_backward"] = True
        node.meta["custom"] = dict(SAVED)  # inherited through seq_nr: never a saved value
        return node

    def done(self, *outs: torch.fx.Node) -> dict[str, torch.fx.Node]:
        self.g.output(outs)
        return self.n


def _saved(n: dict[str, torch.fx.Node]) -> list[str]:
    graph = next(iter(n.values())).graph
    return [v.name for v in replayed_saves(graph).values]


def test_rmsnorm_backward_nodes_never_claim_a_saved_value() -> None:
    """Embedding -> RMSNorm: the first partition saved ``rsqrt`` and the input; the backward's
    ``pow``/``mul``/``neg`` (tangent-independent, tagged by seq_nr) are not saves."""
    r = Retrace()
    x = r.ph("primals_1", 4, 8)
    t = r.ph("tangents_1", 4, 8)
    emb = r.fwd("embedding", aten.relu.default, x, tag=SAVED)
    sq = r.fwd("pow", aten.pow.Tensor_Scalar, emb, 2)
    rsqrt = r.fwd("rsqrt", aten.rsqrt.default, sq, tag=SAVED)
    out = r.fwd("mul", aten.mul.Tensor, emb, rsqrt)
    pow_b = r.bwd("pow_bw", aten.pow.Tensor_Scalar, rsqrt, 3)  # reads rsqrt: no tangent
    neg = r.bwd("neg_bw", aten.neg.default, pow_b)
    grad = r.bwd("mul_bw", aten.mul.Tensor, t, neg)
    grad_x = r.bwd("mul_bw2", aten.mul.Tensor, grad, emb)
    n = r.done(out, grad_x)
    resolved = replayed_saves(r.g)
    assert [v.name for v in resolved.values] == ["embedding", "rsqrt"]
    assert set(resolved.backward_tagged) == {"pow_bw", "neg_bw", "mul_bw", "mul_bw2"}
    assert n["pow_bw"] not in resolved.values


def test_decomposed_silu_saves_the_value_not_its_fp32_chain() -> None:
    """A bf16 ``silu`` the retrace decomposes into upcast -> neg -> exp -> add -> div -> downcast:
    every node inherits the tag; only the downcast (the value the backward reads) is saved."""
    r = Retrace()
    x = r.ph("primals_1", 4, 8)
    t = r.ph("tangents_1", 4, 8)
    up = r.fwd(
        "convert_element_type", prims.convert_element_type.default, x, torch.float32, tag=SAVED
    )
    neg = r.fwd("neg", aten.neg.default, up, tag=SAVED)
    exp = r.fwd("exp", aten.exp.default, neg, tag=SAVED)
    add = r.fwd("add", aten.add.Tensor, exp, 1, tag=SAVED)
    div = r.fwd("div", aten.div.Tensor, up, add, tag=SAVED)
    down = r.fwd(
        "convert_element_type_1", prims.convert_element_type.default, div, torch.bfloat16, tag=SAVED
    )
    loss = r.fwd("sum", aten.sum.default, down)
    grad = r.bwd("mul_bw", aten.mul.Tensor, t, down)
    n = r.done(loss, grad)
    resolved = replayed_saves(r.g)
    assert [v.name for v in resolved.values] == ["convert_element_type_1"]
    assert set(resolved.not_read) == {"convert_element_type", "neg", "exp", "add", "div"}
    assert n["sum"] not in resolved.values


def _layer_norm(indices: list[int]) -> Retrace:
    """``native_layer_norm`` (first compile saved outputs ``indices`` of 3) decomposed by the
    retrace into ``var_mean`` (2 outputs) + arithmetic; the backward reads mean and rstd."""
    r = Retrace()
    x = r.ph("primals_1", 4, 8)
    t = r.ph("tangents_1", 4, 8)
    tag = {**SAVED, MUST_SAVE_INDICES: indices}
    vm = r.fwd(
        "var_mean",
        aten.var_mean.correction,
        x,
        [1],
        tag=tag,
        val=(torch.empty(4, 1), torch.empty(4, 1)),
    )
    var = r.fwd("getitem", operator.getitem, vm, 0, tag=tag, val=torch.empty(4, 1))
    mean = r.fwd("getitem_1", operator.getitem, vm, 1, tag=tag, val=torch.empty(4, 1))
    eps = r.fwd("add", aten.add.Tensor, var, 1e-5, tag=tag, val=torch.empty(4, 1))
    rstd = r.fwd("rsqrt", aten.rsqrt.default, eps, tag=tag, val=torch.empty(4, 1))
    sub = r.fwd("sub", aten.sub.Tensor, x, mean, tag=tag)
    out = r.fwd("mul", aten.mul.Tensor, sub, rstd, tag=tag)
    # the retraced backward (native_layer_norm_backward, decomposed) reads x, mean and rstd
    xm = r.bwd("sub_bw", aten.sub.Tensor, x, mean)
    xh = r.bwd("mul_bw", aten.mul.Tensor, xm, rstd)
    grad = r.bwd("mul_bw2", aten.mul.Tensor, t, xh)
    r.done(out, grad)
    return r


def test_layer_norm_saved_outputs_map_by_meaning_not_by_index() -> None:
    r = _layer_norm([1, 2])  # mean and rstd; index 2 does not exist on var_mean
    resolved = replayed_saves(r.g)
    assert [v.name for v in resolved.values] == ["getitem_1", "rsqrt"]
    assert set(resolved.not_read) == {"getitem", "add", "sub", "mul"}


def test_batch_norm_saved_statistics_map_by_meaning() -> None:
    """``native_batch_norm`` (5 outputs; the first partition saved the two saved statistics)
    retraced as ``_native_batch_norm_legit_functional`` + getitems: the backward reads them."""
    r = Retrace()
    x = r.ph("primals_1", 4, 8)
    w = r.ph("primals_2", 8)
    t = r.ph("tangents_1", 4, 8)
    tag = {**SAVED, MUST_SAVE_INDICES: [3, 4]}
    bn = r.fwd(
        "bn",
        aten._native_batch_norm_legit_functional.default,
        x,
        w,
        None,
        None,
        None,
        True,
        0.1,
        1e-5,
        tag=tag,
        val=tuple(torch.empty(8) for _ in range(5)),
    )
    out = r.fwd("getitem", operator.getitem, bn, 0, tag=tag)
    mean = r.fwd("getitem_1", operator.getitem, bn, 1, tag=tag, val=torch.empty(8))
    invstd = r.fwd("getitem_2", operator.getitem, bn, 2, tag=tag, val=torch.empty(8))
    back = r.bwd("bn_bw", aten.mul.Tensor, t, invstd)
    back2 = r.bwd("bn_bw2", aten.sub.Tensor, back, mean)
    r.done(out, back2)
    resolved = replayed_saves(r.g)
    assert [v.name for v in resolved.values] == ["getitem_1", "getitem_2"]
    assert resolved.not_read == ("getitem",)


def test_sdpa_outputs_read_through_detach() -> None:
    """SDPA survives the retrace: its output and logsumexp are saved; AOTAutograd hands saved
    tensors to the backward as ``detach(x)``, which is what the backward reads -- and what is
    saved (the same storage as the getitem)."""
    r = Retrace()
    q = r.ph("primals_1", 4, 8)
    t = r.ph("tangents_1", 4, 8)
    tag = {**SAVED, MUST_SAVE_INDICES: [0, 1]}
    sdpa = r.fwd(
        "sdpa",
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        q,
        q,
        q,
        tag=tag,
        val=(torch.empty(4, 8), torch.empty(4)),
    )
    out = r.fwd("getitem", operator.getitem, sdpa, 0, tag=tag)
    lse = r.fwd("getitem_1", operator.getitem, sdpa, 1, tag=tag, val=torch.empty(4))
    d_out = r.fwd("detach", aten.detach.default, out)
    d_lse = r.fwd("detach_1", aten.detach.default, lse, val=torch.empty(4))
    grad = r.bwd("sdpa_bw", aten.mul.Tensor, t, d_out)
    grad2 = r.bwd("sdpa_bw2", aten.mul.Tensor, grad, d_lse)
    r.done(out, grad2)
    assert _saved(r.n) == ["detach", "detach_1"]


def test_a_graph_without_backward_marks_takes_tags_as_written() -> None:
    """Hand-built joints without autograd_backward marks cannot tell interiors from values:
    every tagged forward node is saved, getitems by the parent's index list."""
    r = _layer_norm([1])
    for node in r.g.nodes:
        node.meta.pop("autograd_backward", None)
    names = _saved(r.n)
    assert "getitem_1" in names and "getitem" not in names  # index list honoured
    assert {"add", "rsqrt", "sub", "mul"} <= set(names)  # every tagged node, as written


@pytest.mark.parametrize("bad", ["graph", 3])
def test_refuses_non_graphs(bad: object) -> None:
    with pytest.raises(TypeError, match="replayed_saves: graph must be"):
        replayed_saves(bad)  # type: ignore[arg-type]


def test_a_tagged_view_whose_base_the_backward_reads() -> None:
    """The first partition saved ``view(logits)``; the retraced backward reads ``logits``
    itself. Same storage: the base is what is saved."""
    r = Retrace()
    x = r.ph("primals_1", 4, 8)
    t = r.ph("tangents_1", 4, 8)
    logits = r.fwd("mm", aten.relu.default, x)
    view = r.fwd("view", aten.view.default, logits, [32], tag=SAVED, val=torch.empty(32))
    loss = r.fwd("sum", aten.sum.default, view, val=torch.empty(()))
    grad = r.bwd("sub_bw", aten.sub.Tensor, t, logits)
    r.done(loss, grad)
    resolved = replayed_saves(r.g)
    assert [v.name for v in resolved.values] == ["mm"]
    assert resolved.not_read == ()


def test_a_value_whose_tag_the_retrace_lost_is_still_saved() -> None:
    """The first partition saved ``_unsafe_view(logits)`` to the same shape; the retrace traced
    that no-op to nothing, so the value sits on the untagged ``mm``, which the backward reads
    (recomputing it there would redo a matmul)."""
    r = Retrace()
    x = r.ph("primals_1", 4, 8)
    t = r.ph("tangents_1", 4, 8)
    h = r.fwd("relu", aten.relu.default, x, tag=SAVED)
    logits = r.fwd("mm", aten.mm.default, h, h)
    loss = r.fwd("sum", aten.sum.default, logits, val=torch.empty(()))
    grad = r.bwd("sub_bw", aten.sub.Tensor, t, logits)
    grad2 = r.bwd("mul_bw", aten.mul.Tensor, grad, h)
    r.done(loss, grad2)
    resolved = replayed_saves(r.g)
    assert [v.name for v in resolved.values] == ["relu", "mm"]
    assert resolved.untagged_read == ("mm",)


def test_a_graph_without_save_tags_is_no_replay() -> None:
    r = _layer_norm([1, 2])
    for node in r.g.nodes:
        node.meta.pop("custom", None)
    resolved = replayed_saves(r.g)
    assert resolved.values == () and resolved.notes() == ()


def test_an_untagged_constant_the_backward_reads_is_recomputed_not_saved() -> None:
    """Inductor's joint passes hoist constants (``scalar_tensor``, ``arange``) that forward and
    backward share; recomputing one in the backward is free, keeping it alive is not."""
    r = Retrace()
    x = r.ph("primals_1", 4, 8)
    t = r.ph("tangents_1", 4, 8)
    h = r.fwd("relu", aten.relu.default, x, tag=SAVED)
    const = r.fwd("scalar_tensor", aten.scalar_tensor.default, 2.0, val=torch.empty(()))
    out = r.fwd("mul", aten.mul.Tensor, h, const)
    grad = r.bwd("mul_bw", aten.mul.Tensor, t, const)
    grad2 = r.bwd("mul_bw2", aten.mul.Tensor, grad, h)
    r.done(out, grad2)
    resolved = replayed_saves(r.g)
    assert [v.name for v in resolved.values] == ["relu"]


def test_a_tagged_constant_a_joint_pass_created_is_recomputed_not_saved() -> None:
    """Inductor's joint passes replace the cross-entropy backward's scatter with
    ``where(iota == target, scalar_tensor(-1.0), scalar_tensor(0))``: the constants copy the save
    tag the replaced backward node inherited but carry no ``partitioner_tag`` (AOTAutograd did
    not trace them). The first partition never saw them. A node no trace created that only the
    backward reads is a backward node (``ap_tags.graph.is_pass_created``): recomputed there,
    not a save candidate at all."""
    r = Retrace()
    x = r.ph("primals_1", 4, 8)
    t = r.ph("tangents_1", 4, 8)
    h = r.fwd("relu", aten.relu.default, x, tag=SAVED)
    h.meta["partitioner_tag"] = "is_forward"
    const = r.fwd("scalar_tensor_default", aten.scalar_tensor.default, -1.0, tag=SAVED)
    const.meta["val"] = torch.empty(())
    grad = r.bwd("mul_bw", aten.mul.Tensor, t, const)
    grad2 = r.bwd("mul_bw2", aten.mul.Tensor, grad, h)
    r.done(h, grad2)
    resolved = replayed_saves(r.g)
    assert [v.name for v in resolved.values] == ["relu"]
    assert const in backward_nodes(r.g)
    assert resolved.constants == ()


def test_a_tagged_constant_the_forward_shares_is_recomputed_and_named() -> None:
    """A constant a joint pass hoisted and shares between forward and backward (no
    ``partitioner_tag``, read by both): a forward node, but free to recompute, so not saved;
    the replay names it."""
    r = Retrace()
    x = r.ph("primals_1", 4, 8)
    t = r.ph("tangents_1", 4, 8)
    const = r.fwd("scalar_tensor_default", aten.scalar_tensor.default, -1.0, tag=SAVED)
    const.meta["val"] = torch.empty(())
    h = r.fwd("mul", aten.mul.Tensor, x, const, tag=SAVED)
    h.meta["partitioner_tag"] = "is_forward"
    grad = r.bwd("mul_bw", aten.mul.Tensor, t, const)
    grad2 = r.bwd("mul_bw2", aten.mul.Tensor, grad, h)
    r.done(h, grad2)
    resolved = replayed_saves(r.g)
    assert [v.name for v in resolved.values] == ["mul"]
    assert const not in backward_nodes(r.g)
    assert resolved.constants == ("scalar_tensor_default",)
    assert any("scalar_tensor_default" in line for line in resolved.notes())


def test_a_tagged_forward_constant_the_first_partition_saved_is_saved() -> None:
    r = Retrace()
    x = r.ph("primals_1", 4, 8)
    t = r.ph("tangents_1", 4, 8)
    h = r.fwd("relu", aten.relu.default, x, tag=SAVED)
    const = r.fwd("full", aten.scalar_tensor.default, 2.0, tag=SAVED)
    const.meta["val"] = torch.empty(())
    const.meta["partitioner_tag"] = "is_forward"
    grad = r.bwd("mul_bw", aten.mul.Tensor, t, const)
    grad2 = r.bwd("mul_bw2", aten.mul.Tensor, grad, h)
    r.done(h, grad2)
    resolved = replayed_saves(r.g)
    assert {v.name for v in resolved.values} == {"relu", "full"}
    assert resolved.constants == ()


def _from(node: torch.fx.Node, first: torch.fx.Node, pass_name: str = "Interpreter_X") -> None:
    """Record ``first`` as the node ``node`` was traced from, as ``fx.Interpreter`` does."""
    from torch.fx.traceback import NodeSource, NodeSourceAction

    node.meta["from_node"] = [NodeSource(first, pass_name, NodeSourceAction.CREATE)]


def _first_forward(*names: str) -> dict[str, torch.fx.Node]:
    """Nodes of a first-partition forward graph, by name (only their names matter)."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    out = {}
    for name in names:
        node = g.call_function(aten.relu.default, (x,))
        node.name = name
        out[name] = node
    return out


def test_first_partition_saves_the_backward_never_reads_are_named_dropped() -> None:
    """Cross-entropy with ``reduction="sum"``: the first partition saved ``relu``,
    ``_log_softmax`` and ``nll_loss_forward``'s output 1 (``total_weight``, an argument its
    backward never used). The retrace decomposes both ops; the backward reads ``relu`` and the
    last node of the log-softmax chain, nothing of nll_loss. Only ``nll_loss_forward[1]`` is
    dropped: the unread interiors of ``_log_softmax`` are not (its value is saved)."""
    first = _first_forward("relu", "_log_softmax", "nll_loss_forward")
    r = Retrace()
    x = r.ph("primals_1", 4, 8)
    t = r.ph("tangents_1", 4, 8)
    relu = r.fwd("relu", aten.relu.default, x, tag=SAVED)
    amax = r.fwd("amax", aten.amax.default, relu, tag=SAVED)
    sub_1 = r.fwd("sub_1", aten.sub.Tensor, relu, amax, tag=SAVED)
    nll_tag = {**SAVED, MUST_SAVE_INDICES: [1]}
    ne = r.fwd("ne", aten.neg.default, sub_1, tag=nll_tag)
    total = r.fwd("sum_3", aten.sum.default, ne, tag=nll_tag)
    for node, source in [(relu, "relu"), (amax, "_log_softmax"), (sub_1, "_log_softmax")]:
        _from(node, first[source])
    for node in (ne, total):
        _from(node, first["nll_loss_forward"])
    back = r.bwd("mul", aten.mul.Tensor, t, relu)
    back2 = r.bwd("mul_1", aten.mul.Tensor, back, sub_1)
    r.done(total, back2)
    resolved = replayed_saves(r.g)
    assert [v.name for v in resolved.values] == ["relu", "sub_1"]
    assert resolved.dropped == ("nll_loss_forward[1]",)
    assert any("nll_loss_forward[1]" in line for line in resolved.notes())


def test_provenance_follows_a_named_pass_back_to_the_interpreted_node() -> None:
    """A joint pass that replaced a node records itself as the source; the first-partition
    name is the interpreted node behind it. A node no interpreted node produced has none."""
    first = _first_forward("mm")
    r = Retrace()
    x = r.ph("primals_1", 4, 8)
    joint_node = r.fwd("mm_joint", aten.relu.default, x)
    _from(joint_node, first["mm"])
    replaced = r.fwd("mm_fused", aten.relu.default, x)
    _from(replaced, joint_node, pass_name="pattern_matcher")
    assert first_partition_name(replaced) == "mm"
    assert first_partition_name(x) is None


def test_a_joint_pass_interior_the_backward_alone_reads_is_backward() -> None:
    """Inductor's joint pass turns the cross-entropy backward's ``scatter(full, 1, target, -1)``
    into ``where(eq(expand(target), iota), -1, 0)``: only the ``where`` copies the scatter's
    meta; ``expand`` / ``eq`` carry no mark at all. They feed only the backward, so they are
    backward nodes, and the replay saves the ``[N]`` target the first partition saved, not the
    ``[N, V]`` ``eq`` mask (the label-shift loss tail: 896 B of bools saved for 112 B)."""
    r = Retrace()
    x = r.ph("primals_1", 4, 8)
    t = r.ph("tangents_1", 4, 8)
    target = r.fwd(
        "where_2", aten.relu.default, x, tag=SAVED, val=torch.empty(4, dtype=torch.int64)
    )
    target.meta["partitioner_tag"] = "is_forward"
    h = r.fwd("relu", aten.relu.default, x, tag=SAVED)
    h.meta["partitioner_tag"] = "is_forward"
    expand = r.fwd("expand_default", aten.expand.default, target, [4, 8])
    eq = r.fwd("eq_tensor", aten.eq.Tensor, expand, x, val=torch.empty(4, 8, dtype=torch.bool))
    where = r.fwd("where_self", aten.where.self, eq, t, t)
    where.meta["partitioner_tag"] = "is_backward"  # the replaced scatter's meta
    grad = r.bwd("mul_bw", aten.mul.Tensor, where, h)
    r.done(h, grad)
    assert {expand, eq} <= backward_nodes(r.g)
    assert {v.name for v in replayed_saves(r.g).values} == {"relu", "where_2"}


def test_untagged_nodes_keep_their_direction_on_a_graph_without_forward_stamps() -> None:
    """A hand-built joint (no ``partitioner_tag`` anywhere) cannot tell a pass-created node
    from a forward one: a forward value only the backward reads stays forward there."""
    r = Retrace()
    x = r.ph("primals_1", 4, 8)
    t = r.ph("tangents_1", 4, 8)
    h = r.fwd("relu", aten.relu.default, x, tag=SAVED)
    cos = r.fwd("cos", aten.cos.default, x, tag=SAVED)
    grad = r.bwd("mul_bw", aten.mul.Tensor, t, cos)
    r.done(h, grad)
    assert cos not in backward_nodes(r.g)
