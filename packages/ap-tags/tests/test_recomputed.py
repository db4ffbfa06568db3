"""release_recomputed_saves: a backward graph's recomputed forward ops lose inherited save tags.

The first partition recomputed these ops in the backward; the save directives they carry were
copied from the joint (``recompute``) or are the *forward* node's ``custom`` dict, shared by
``node_copy``. Retraced into the second compilation they would make the replay save a value
the first partition recomputed.
"""

from __future__ import annotations

import operator

import pytest
import torch
from ap_tags import (
    CUSTOM,
    MUST_SAVE,
    MUST_SAVE_INDICES,
    RECOMPUTE,
    preserve_meta_compiler,
    release_recomputed_saves,
)
from ap_tags._recomputed import mark_backward_graph
from torch.utils.checkpoint import CheckpointPolicy

aten = torch.ops.aten
SDPA = aten._scaled_dot_product_flash_attention_for_cpu.default


def _graphs(
    *, backward: bool = True
) -> tuple[torch.fx.GraphModule, dict[str, torch.fx.Node], dict[str, object]]:
    """A backward-like graph: a recomputed SDPA (forward op) feeding a real backward op.

    The SDPA copy shares ``shared`` as its ``custom`` dict, as extraction leaves it."""
    g = torch.fx.Graph()
    q = g.placeholder("q")
    grad = g.placeholder("tangents_1")
    sdpa = g.create_node("call_function", SDPA, (q, q, q), name="sdpa")
    out = g.create_node("call_function", operator.getitem, (sdpa, 0), name="out")
    gather = g.create_node("call_function", aten.t.default, (q,), name="gather")
    mul = g.create_node("call_function", aten.mul.Tensor, (out, grad), name="mul")
    g.output((mul, gather))
    shared: dict[str, object] = {MUST_SAVE: True, MUST_SAVE_INDICES: [1], "module_fqn": "attn"}
    for node, tag in (
        (sdpa, "is_forward"),
        (out, "is_forward"),
        (gather, "is_forward"),
        (mul, "is_backward" if backward else "is_forward"),
    ):
        node.meta["partitioner_tag"] = tag
        if backward:
            node.meta["autograd_backward"] = True
    sdpa.meta[CUSTOM] = shared
    sdpa.meta[RECOMPUTE] = CheckpointPolicy.MUST_SAVE
    out.meta[RECOMPUTE] = CheckpointPolicy.PREFER_SAVE
    gather.meta[RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE
    mul.meta[CUSTOM] = {MUST_SAVE: True}  # a genuine backward node: left alone
    mul.meta[RECOMPUTE] = CheckpointPolicy.MUST_SAVE
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    return gm, {n.name: n for n in gm.graph.nodes}, shared


def test_recomputed_forward_ops_lose_save_tags() -> None:
    gm, n, shared = _graphs()
    changed = release_recomputed_saves(gm)
    sdpa = n["sdpa"]
    assert set(changed) == {"sdpa", "out"}
    assert sdpa.meta[CUSTOM] == {"module_fqn": "attn"}  # other keys kept
    assert RECOMPUTE not in sdpa.meta and RECOMPUTE not in n["out"].meta


def test_shared_custom_dict_is_not_mutated() -> None:
    """The forward node holds the same dict: its replay tag must survive."""
    gm, n, shared = _graphs()
    release_recomputed_saves(gm)
    assert shared == {MUST_SAVE: True, MUST_SAVE_INDICES: [1], "module_fqn": "attn"}
    assert n["sdpa"].meta[CUSTOM] is not shared


def test_recompute_policies_and_backward_ops_are_kept() -> None:
    gm, n, _ = _graphs()
    release_recomputed_saves(gm)
    assert n["gather"].meta[RECOMPUTE] is CheckpointPolicy.MUST_RECOMPUTE
    assert n["mul"].meta[RECOMPUTE] is CheckpointPolicy.MUST_SAVE
    assert n["mul"].meta[CUSTOM] == {MUST_SAVE: True}


def test_forward_graph_is_left_alone() -> None:
    gm, n, shared = _graphs(backward=False)
    assert release_recomputed_saves(gm) == ()
    sdpa = n["sdpa"]
    assert sdpa.meta[CUSTOM] is shared
    assert sdpa.meta[RECOMPUTE] is CheckpointPolicy.MUST_SAVE


def test_backward_compiler_releases_but_forward_compiler_does_not() -> None:
    gm, n, _ = _graphs()
    preserve_meta_compiler()(gm, [])
    assert RECOMPUTE not in n["sdpa"].meta
    gm, n, _ = _graphs()
    preserve_meta_compiler(tag_forward=True, num_fwd_outputs=2)(gm, [])
    assert n["sdpa"].meta[RECOMPUTE] is (CheckpointPolicy.MUST_SAVE)


def _as_torch_2_12_extracts(gm: torch.fx.GraphModule) -> None:
    """torch 2.12's backward extraction leaves ``autograd_backward`` off; only AOTAutograd's
    ``partitioner_tag`` says which nodes are backward ones."""
    for node in gm.graph.nodes:
        node.meta.pop("autograd_backward", None)


def test_backward_compiler_marks_every_node_of_a_backward_graph_backward() -> None:
    """The second compilation's tracer copies ``autograd_backward`` from the interpreted node;
    without it the recomputed SDPA copy is retraced as a forward node and the replay saves its
    output (the forward then runs SDPA twice: torch 2.12)."""
    gm, n, _ = _graphs()
    _as_torch_2_12_extracts(gm)
    preserve_meta_compiler()(gm, [])
    assert {name for name, node in n.items() if node.meta.get("autograd_backward")} == {
        "sdpa",
        "out",
        "gather",
        "mul",
    }
    assert mark_backward_graph(gm) == 0  # idempotent


def test_forward_graph_is_not_marked_backward() -> None:
    gm, n, _ = _graphs(backward=False)
    assert mark_backward_graph(gm) == 0
    preserve_meta_compiler(tag_forward=True, num_fwd_outputs=2)(gm, [])
    assert not any(node.meta.get("autograd_backward") for node in n.values())


def test_forward_compiler_clears_the_backward_mark_of_nodes_min_cut_moved_forward() -> None:
    """Min-cut moves a backward-origin node that reads only forward values into the forward
    when its output is cheaper to save (relu's backward mask ``le(relu, 0)``); extraction
    copies the joint node's ``autograd_backward``. The forward compiler clears it: the second
    compilation's tracer copies the mark, and the replay took the saved mask for a backward
    node and recomputed it (a cross-entropy head: 6 first-partition saves, 5 replayed)."""
    gm, n, _ = _graphs(backward=False)
    n["gather"].meta["autograd_backward"] = True  # a backward-origin node min-cut moved
    preserve_meta_compiler(tag_forward=True, num_fwd_outputs=2)(gm, [])
    assert not any("autograd_backward" in node.meta for node in n.values())


def test_on_a_tracer_without_the_mark_recomputed_ops_are_retagged_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.11's tracer copies ``partitioner_tag`` only: the recomputed forward ops must
    carry the backward tag there, or the second compile retraces them as forward nodes."""
    import ap_tags._recomputed as recomputed

    monkeypatch.setattr(recomputed, "tracer_copies_autograd_backward", lambda: False)
    gm, n, _ = _graphs()
    _as_torch_2_12_extracts(gm)
    preserve_meta_compiler()(gm, [])
    for name in ("sdpa", "out", "gather", "mul"):
        assert n[name].meta["partitioner_tag"] == "is_backward", name
    monkeypatch.setattr(recomputed, "tracer_copies_autograd_backward", lambda: True)
    gm, n, _ = _graphs()
    preserve_meta_compiler()(gm, [])
    assert n["sdpa"].meta["partitioner_tag"] == "is_forward"  # 2.12+: the mark is enough
