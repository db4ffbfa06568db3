"""``ep_chunk`` and the joint graph of a nested compiled region.

AOTAutograd partitions the body of an ``invoke_subgraph`` (torchtitan's DeepSeek-V3 attention)
as a joint graph of its own, through the same joint pass; the token marks name the compiled
graph's inputs, not that body's arguments. The backend leaves such a joint alone, and still
refuses a graph Dynamo handed it in which no region matches.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx
from ap_backend import autoparallel_backend
from ap_epchunk import ChunkConfig, ChunkError
from torch._functorch._aot_autograd.descriptors import PlainAOTInput


def _joint(n_inputs: int) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    args = []
    for i in range(n_inputs):
        p = graph.placeholder(f"primals_{i + 1}")
        p.meta["desc"] = PlainAOTInput(i)
        p.meta["val"] = torch.empty(4, 4, device="meta")
        args.append(p)
    graph.output(graph.call_function(torch.ops.aten.add.Tensor, (args[0], args[-1])))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_a_nested_regions_joint_is_left_alone() -> None:
    backend = autoparallel_backend(ep_chunk=ChunkConfig(("layers.*.moe",), num_chunks=2))
    gm = _joint(2)
    before = str(gm.graph)
    out = backend._joint_pass(gm, [], graph_inputs=[torch.zeros(4, 4)] * 5)
    assert out is gm and str(gm.graph) == before
    assert backend.chunk_reports == []


def test_the_compiled_graphs_own_joint_is_still_refused_without_a_region() -> None:
    backend = autoparallel_backend(ep_chunk=ChunkConfig(("layers.*.moe",), num_chunks=2))
    with pytest.raises(ChunkError, match="no region matched"):
        backend._joint_pass(_joint(3), [], graph_inputs=[torch.zeros(4, 4)] * 3)
