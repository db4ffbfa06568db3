"""Region selection: custom FQNs, nn_module_stack fallback, backward FQNs via seq_nr, patterns."""

from __future__ import annotations

from typing import Any

import torch
from ap_epchunk import ChunkConfig, chunk_pass
from ap_epchunk._regions import find_regions, module_fqns, root_of

aten = torch.ops.aten


def test_root_of_matches_leading_components_with_fnmatch() -> None:
    assert root_of("layers.3.moe.experts.1", ("layers.*.moe",)) == "layers.3.moe"
    assert root_of("layers.3.attention", ("layers.*.moe",)) is None
    assert root_of("layers.12", ("layers.1?",)) == "layers.12"
    assert root_of("layers", ("layers.*",)) is None


def test_nn_module_stack_fallback_and_backward_fqn_from_seq_nr(fake_graph: Any) -> None:
    b = fake_graph()
    u0 = b.unbacked(8)
    w = b.placeholder("w", b.fake(3, 3))
    x = b.placeholder("x", b.fake(u0, 3))
    fwd = b.op(aten.mm.default, x, w)  # no custom: Dynamo-style module stack only
    fwd.meta["nn_module_stack"] = {"k": ("L['self'].layers[1].mlp", torch.nn.Linear)}
    fwd.meta["seq_nr"] = 7
    act = b.op(aten.relu.default, fwd)
    act.meta["custom"] = {"module_fqn": "layers.1.mlp"}
    bwd = b.op(aten.mm.default, act, w, backward=True)  # no FQN at all: borrowed via seq_nr
    bwd.meta["seq_nr"] = 7
    stray = b.op(aten.neg.default, bwd, backward=True)  # no FQN, no matching seq_nr
    gm = b.module(stray)
    fqns = module_fqns(gm.graph)
    assert fqns[fwd] == "layers.1.mlp" and fqns[bwd] == "layers.1.mlp"
    assert stray not in fqns
    regions = find_regions(gm.graph, ("layers.*",), fqns)
    assert [(r.root, r.backward, len(r.candidates)) for r in regions] == [
        ("layers.1", False, 2),
        ("layers.1", True, 1),
    ]
    report = chunk_pass(
        gm, ChunkConfig(module_patterns=("layers.*",), early_grad_accumulation=False)
    )
    assert [(r.root, r.backward, r.body_nodes) for r in report.regions] == [
        ("layers.1", False, 2),
        ("layers.1", True, 1),
    ]
    # the saved activation reaches the backward region chunk by chunk: a single split (x),
    # one cat (the backward value escaping to the stray user), no cat-then-split
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(aten.split_with_sizes.default) == 1
    assert targets.count(aten.cat.default) == 1
    out = gm(torch.randn(3, 3), torch.randn(8, 3))[0]
    assert out.shape == (8, 3)


def test_gradient_sums_join_the_module_that_encloses_them(fake_graph: Any) -> None:
    """Autograd's sum of a value's two gradients (a MoE's routed tokens feed two expert
    matmuls) has no forward op and no module. Between two ops of ``layers.0.moe`` it belongs
    to ``layers.0.moe`` (the innermost module around its inputs and users); left out, the
    region's gradients looked like values leaving it. In a graph retraced from a first
    compilation (backward FQNs stamped) ``seq_nr`` names nothing, so it is not used."""
    b = fake_graph()
    x = b.placeholder("x", b.fake(8, 4))
    w1 = b.placeholder("w1", b.fake(4, 4))
    w3 = b.placeholder("w3", b.fake(4, 4))
    tagged = {"ap_chunk_backward_fqn": "layers.0.moe.experts"}
    g1 = b.op(aten.mm.default, x, w1, backward=True)
    g3 = b.op(aten.mm.default, x, w3, backward=True)
    summed = b.op(aten.add.Tensor, g1, g3, backward=True)  # autograd's: no FQN of its own
    summed.meta["seq_nr"] = 3
    scatter = b.op(aten.neg.default, summed, backward=True)
    last = b.op(aten.relu.default, scatter, backward=True)  # feeds the outputs only
    for node in (g1, g3):
        node.meta["custom"] = dict(tagged)
    scatter.meta["custom"] = {"ap_chunk_backward_fqn": "layers.0.moe"}
    embed = b.op(aten.mm.default, x, w1)
    embed.meta.update(seq_nr=3, custom={"module_fqn": "tok_embeddings"})
    gm = b.module(last, embed)
    fqns = module_fqns(gm.graph)
    assert fqns[summed] == "layers.0.moe"  # not tok_embeddings through seq_nr 3
    assert last not in fqns
    (region,) = [r for r in find_regions(gm.graph, ("layers.*.moe",), fqns) if r.backward]
    assert region.candidates == (g1, g3, summed, scatter)


def test_restore_backward_module_fqns_puts_back_each_nodes_own_module() -> None:
    """A retraced backward where torch's metadata copy named one module for every node (one
    shared ``custom`` dict): each node stamped by ``tag_backward_module_fqns`` gets its stamped
    FQN as ``module_fqn``, unstamped nodes keep theirs, and no dict is mutated in place."""
    import torch
    from ap_epchunk import restore_backward_module_fqns

    g = torch.fx.Graph()
    x = g.placeholder("x")
    shared = {"module_fqn": "tok_embeddings"}
    a = g.call_function(torch.ops.aten.relu.default, (x,))
    b = g.call_function(torch.ops.aten.neg.default, (a,))
    c = g.call_function(torch.ops.aten.exp.default, (b,))
    g.output(c)
    a.meta["custom"] = {**shared, "ap_chunk_backward_fqn": "layers.0.attention.wq"}
    b.meta["custom"] = shared
    c.meta["custom"] = {**shared, "ap_chunk_backward_fqn": "tok_embeddings"}
    assert restore_backward_module_fqns(g) == 1
    assert a.meta["custom"]["module_fqn"] == "layers.0.attention.wq"
    assert b.meta["custom"] == {"module_fqn": "tok_embeddings"} and shared["module_fqn"] == (
        "tok_embeddings"
    )
    assert c.meta["custom"]["module_fqn"] == "tok_embeddings"
    assert restore_backward_module_fqns(g) == 0


def test_backward_module_fqns_lost_lists_backward_collectives_without_their_stamp() -> None:
    """A backward reduce-scatter that names a module but lost its stamp is listed; a stamped
    one, a forward all-gather and an unnamed collective are not."""
    import torch
    from ap_epchunk import backward_module_fqns_lost

    c10d = torch.ops._c10d_functional
    g = torch.fx.Graph()
    x = g.placeholder("x")
    gather = g.call_function(c10d.all_gather_into_tensor.default, (x, 8, "0"))
    kept = g.call_function(c10d.reduce_scatter_tensor.default, (gather, "sum", 8, "0"))
    lost = g.call_function(c10d.reduce_scatter_tensor.default, (kept, "sum", 8, "0"))
    unnamed = g.call_function(c10d.reduce_scatter_tensor.default, (lost, "sum", 8, "0"))
    g.output(unnamed)
    gather.meta["custom"] = {"module_fqn": "tok_embeddings"}
    for node in (kept, lost, unnamed):
        node.meta["partitioner_tag"] = "is_backward"
    kept.meta["custom"] = {"module_fqn": "layers.0", "ap_chunk_backward_fqn": "layers.0.w1"}
    lost.meta["custom"] = {"module_fqn": "tok_embeddings"}
    assert backward_module_fqns_lost(g) == [lost.name]
    lost.meta["custom"] = {"module_fqn": "tok_embeddings", "ap_chunk_backward_fqn": "layers.1"}
    assert backward_module_fqns_lost(g) == []


def test_a_forward_gather_the_partition_recomputed_in_the_backward_is_not_lost() -> None:
    """The second partition of an activation budget re-issued forward all-gathers in its
    backward graph (the kit's ``norm`` / ``output`` / ``tok_embeddings`` weights): torch marks
    them ``autograd_backward`` with the rest of the graph, they keep ``partitioner_tag
    "is_forward"`` and their own module. The backend warned they had lost their module name."""
    import torch
    from ap_epchunk import backward_module_fqns_lost

    c10d = torch.ops._c10d_functional
    g = torch.fx.Graph()
    x = g.placeholder("x")
    regathered = g.call_function(c10d.all_gather_into_tensor.default, (x, 8, "0"))
    lost = g.call_function(c10d.reduce_scatter_tensor.default, (regathered, "sum", 8, "0"))
    g.output(lost)
    regathered.meta.update(
        partitioner_tag="is_forward", autograd_backward=True, custom={"module_fqn": "norm"}
    )
    lost.meta.update(autograd_backward=True, custom={"module_fqn": "tok_embeddings"})
    assert backward_module_fqns_lost(g) == [lost.name]
