"""tag_saved_outputs: which forward nodes get ap_must_save, and the getitem-parent rule."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
from ap_tags import (
    MUST_SAVE,
    MUST_SAVE_INDICES,
    TAG_SCHEMA,
    TAG_SCHEMA_VERSION,
    TagError,
    infer_num_fwd_outputs,
    is_must_save,
    must_save_indices,
    tag_saved_outputs,
)
from torch._functorch._aot_autograd.descriptors import (
    PlainAOTOutput,
    SavedForBackwardsAOTOutput,
    SavedForBackwardsNoVcCheckAOTOutput,
)

aten = torch.ops.aten


def _fw_graph(build: Any) -> tuple[torch.fx.GraphModule, dict[str, torch.fx.Node]]:
    """user output ``out``; saved: placeholder ``x``, ``relu``, ``getitem`` 1 and 0 of split."""
    b = build()
    x = b.ph("x")
    relu = b.op(aten.relu.default, (x,), "relu")
    split = b.op(aten.split.Tensor, (relu, 2), "split")
    split.meta["val"] = (torch.empty(2, 8), torch.empty(2, 8))
    g0 = b.op(operator.getitem, (split, 0), "g0")
    g1 = b.op(operator.getitem, (split, 1), "g1")
    out = b.op(aten.sum.default, (g0,), "out")
    gm = b.done(out, x, relu, g1, g0, g1)
    return gm, {n.name: n for n in gm.graph.nodes}


def test_num_fwd_outputs_excludes_user_outputs(build: Any) -> None:
    gm, n = _fw_graph(build)
    report = tag_saved_outputs(gm, num_fwd_outputs=1)
    assert not is_must_save(n["out"])  # the user output is not a save decision
    assert is_must_save(n["relu"])
    assert is_must_save(n["split"]) and must_save_indices(n["split"]) == (1, 0)
    assert "custom" not in n["g0"].meta and "custom" not in n["g1"].meta
    assert "custom" not in n["x"].meta
    assert report.source == "argument" and report.num_fwd_outputs == 1
    assert report.tagged == ("relu", "split")
    assert report.getitem_parents == {"split": (1, 0)}
    assert report.saved_placeholders == ("x",)


def test_without_split_information_every_computed_output_is_tagged(build: Any) -> None:
    gm, n = _fw_graph(build)
    report = tag_saved_outputs(gm)
    assert report.source == "unknown"
    assert is_must_save(n["out"]) and is_must_save(n["relu"])


def test_descriptors_decide_which_outputs_are_saved(build: Any) -> None:
    gm, n = _fw_graph(build)
    out_node = gm.graph.output_node()
    out_node.meta["desc"] = [
        PlainAOTOutput(0),
        SavedForBackwardsAOTOutput(0),
        SavedForBackwardsAOTOutput(1),
        SavedForBackwardsNoVcCheckAOTOutput(2),
        SavedForBackwardsAOTOutput(3),
        SavedForBackwardsAOTOutput(4),
    ]
    assert infer_num_fwd_outputs(gm) == 1
    report = tag_saved_outputs(gm)
    assert report.source == "descriptors" and report.num_fwd_outputs == 1
    assert not is_must_save(n["out"])
    assert report.tagged == ("relu", "split")


def test_all_none_descriptors_are_not_trusted(build: Any) -> None:
    gm, _ = _fw_graph(build)
    gm.graph.output_node().meta["desc"] = [None] * 6
    assert infer_num_fwd_outputs(gm) is None
    assert tag_saved_outputs(gm).source == "unknown"


def test_plain_descriptors_only_mean_nothing_saved(build: Any) -> None:
    gm, n = _fw_graph(build)
    gm.graph.output_node().meta["desc"] = [PlainAOTOutput(i) for i in range(6)]
    report = tag_saved_outputs(gm)
    assert report.tagged == () and report.num_fwd_outputs == 6
    assert not any(is_must_save(v) for v in n.values())


@pytest.mark.parametrize("bad", [-1, 7])
def test_out_of_range_num_fwd_outputs_is_refused(build: Any, bad: int) -> None:
    gm, n = _fw_graph(build)
    with pytest.raises(ValueError, match="num_fwd_outputs"):
        tag_saved_outputs(gm, num_fwd_outputs=bad)
    with pytest.raises(TypeError, match="num_fwd_outputs"):
        tag_saved_outputs(gm, num_fwd_outputs=True)
    assert not any("custom" in v.meta for v in n.values())


def test_malformed_existing_custom_refuses_without_writing(build: Any) -> None:
    gm, n = _fw_graph(build)
    n["split"].meta["custom"] = "oops"
    with pytest.raises(TagError, match="split"):
        tag_saved_outputs(gm, num_fwd_outputs=1)
    assert "custom" not in n["relu"].meta


def test_existing_custom_entries_are_kept(build: Any) -> None:
    gm, n = _fw_graph(build)
    n["relu"].meta["custom"] = {"module_fqn": "layers.0"}
    tag_saved_outputs(gm, num_fwd_outputs=1)
    assert n["relu"].meta["custom"] == {
        "module_fqn": "layers.0",
        MUST_SAVE: True,
        TAG_SCHEMA: TAG_SCHEMA_VERSION,
    }
    assert n["split"].meta["custom"] == {
        MUST_SAVE: True,
        MUST_SAVE_INDICES: [1, 0],
        TAG_SCHEMA: TAG_SCHEMA_VERSION,
    }
