"""validate_tags: every malformed-tag case is reported, all bad nodes in one error."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from ap_tags import (
    CHUNK_GLUE,
    CHUNK_INDEX,
    CHUNK_REGION,
    FSDP_AC_GRAPH_ID,
    MODULE_FQN,
    MUST_SAVE,
    MUST_SAVE_INDICES,
    TagError,
    validate_tags,
)
from torch.utils.checkpoint import CheckpointPolicy


def _graph(n: int) -> tuple[torch.fx.GraphModule, list[torch.fx.Node]]:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    nodes = []
    cur = x
    for i in range(n):
        cur = g.call_function(torch.ops.aten.relu.default, (cur,), name=f"n{i}")
        nodes.append(cur)
    g.output(cur)
    return torch.fx.GraphModule(torch.nn.Module(), g), nodes


def test_well_formed_tags_pass() -> None:
    gm, (a, b, c) = _graph(3)
    a.meta["custom"] = {MUST_SAVE: True, MUST_SAVE_INDICES: [1, 0], MODULE_FQN: "layers.0"}
    a.meta["val"] = (torch.empty(1), torch.empty(1))
    b.meta["custom"] = {CHUNK_INDEX: 0, CHUNK_REGION: "layers.*.moe", CHUNK_GLUE: False}
    b.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    b.meta["ac_graph_id"] = FSDP_AC_GRAPH_ID
    c.meta["custom"] = {"user_key": object()}  # foreign custom keys are not ours to judge
    validate_tags(gm)
    validate_tags(gm.graph)


BAD_CASES = [
    ({"custom": "x"}, "not dict"),
    ({"custom": {MUST_SAVE: 1}}, "ap_must_save must be bool"),
    ({"custom": {MUST_SAVE: True, MUST_SAVE_INDICES: 3}}, "must be a list of ints"),
    ({"custom": {MUST_SAVE: True, MUST_SAVE_INDICES: [0, "1"]}}, "non-int entries"),
    ({"custom": {MUST_SAVE: True, MUST_SAVE_INDICES: [0, True]}}, "non-int entries"),
    ({"custom": {MUST_SAVE: True, MUST_SAVE_INDICES: [-1]}}, "negative indices"),
    ({"custom": {MUST_SAVE: True, MUST_SAVE_INDICES: [1, 0, 1]}}, "duplicate indices"),
    ({"custom": {MUST_SAVE_INDICES: [0]}}, "ap_must_save is not True"),
    ({"custom": {MODULE_FQN: 1}}, "module_fqn must be str"),
    ({"custom": {CHUNK_INDEX: -1}}, "ap_chunk_index must be >= 0"),
    ({"custom": {CHUNK_INDEX: 1.0}}, "ap_chunk_index must be an int"),
    ({"custom": {CHUNK_REGION: None}}, "ap_chunk_region must be str"),
    ({"custom": {CHUNK_GLUE: "yes"}}, "ap_chunk_glue must be bool"),
    ({"recompute": 2}, "recompute must be a CheckpointPolicy"),
    ({"recompute": "MUST_SAVE"}, "recompute must be a CheckpointPolicy"),
    ({"ac_graph_id": "100000"}, "ac_graph_id must be an int"),
    ({"ac_graph_id": True}, "ac_graph_id must be an int"),
]


@pytest.mark.parametrize(("meta", "message"), BAD_CASES)
def test_each_malformed_case_is_named(meta: dict[str, object], message: str) -> None:
    gm, (a, b) = _graph(2)
    b.meta.update(meta)
    with pytest.raises(TagError, match=message) as info:
        validate_tags(gm)
    assert set(info.value.problems) == {"n1"}
    assert "n1" in str(info.value)


def test_index_out_of_range_for_known_output_count() -> None:
    gm, (a,) = _graph(1)
    a.meta["val"] = (torch.empty(1), torch.empty(1))
    a.meta["custom"] = {MUST_SAVE: True, MUST_SAVE_INDICES: [0, 2]}
    with pytest.raises(TagError, match=r"\[2\] out of range for 2 outputs"):
        validate_tags(gm)


def test_every_bad_node_and_every_problem_reported_at_once() -> None:
    gm, (a, b, c) = _graph(3)
    a.meta["custom"] = {MUST_SAVE: "yes"}
    b.meta["recompute"] = 7
    b.meta["ac_graph_id"] = 1.5
    c.meta["custom"] = {MUST_SAVE: True}
    with pytest.raises(TagError) as info:
        validate_tags(gm)
    err = info.value
    assert isinstance(err, ValueError)
    assert set(err.problems) == {"n0", "n1"}
    assert len(err.problems["n1"]) == 2
    assert "2 nodes" in str(err)
