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
