""" "Is this saved value an unsharded weight?" has one answer in the workspace.

ap-partitioner (which refuses to replay a save of one) and ap-backend (which counts them in
every saved-set summary) used to carry their own ``is_all_gather_output``; they disagreed on
``_unsafe_view(wait_tensor(all_gather(...)))`` -- a view autograd does not track as one, which
AOTAutograd emits for reshapes of the gathered weight. Both now export
``ap_tags.graph.is_all_gather_output`` itself, so they cannot disagree.
"""

from __future__ import annotations

import ap_backend
import ap_partitioner
import ap_tags.graph
import pytest
import torch
from ap_testing.graphs import AG, WAIT, Builder

DEFINITIONS = {
    "ap_tags.graph": ap_tags.graph.is_all_gather_output,
    "ap_partitioner": ap_partitioner.is_all_gather_output,
    "ap_backend": ap_backend.is_all_gather_output,
}


def test_one_definition() -> None:
    assert (
        ap_partitioner.is_all_gather_output
        is ap_backend.is_all_gather_output
        is ap_tags.graph.is_all_gather_output
    )


def _unsafe_view_of_gathered_weight() -> dict[str, torch.fx.Node]:
    b = Builder()
    shard = b.ph("shard", (4, 8))
    ag = b.op(AG, (shard, 2, "0"), "ag", (8, 8))
    wait = b.op(WAIT, (ag,), "wait", (8, 8))
    flat = b.op(torch.ops.aten._unsafe_view.default, (wait, [64]), "flat", (64,))
    copied = b.op(torch.ops.aten.clone.default, (flat,), "copied", (64,))
    return {"shard": shard, "wait": wait, "flat": flat, "copied": copied}


@pytest.mark.parametrize("where", sorted(DEFINITIONS))
def test_unsafe_view_of_waited_all_gather_is_an_all_gather_output(where: str) -> None:
    nodes = _unsafe_view_of_gathered_weight()
    is_all_gather_output = DEFINITIONS[where]
    assert is_all_gather_output(nodes["flat"])
    assert is_all_gather_output(nodes["wait"])
    # a copy owns new storage; the shard itself was never gathered
    assert not is_all_gather_output(nodes["copied"])
    assert not is_all_gather_output(nodes["shard"])
