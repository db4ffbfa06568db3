"""Graph safety: every ap-tags pass over random joint graphs with random (valid/invalid) tags.

Property per pass: it either succeeds — ``graph.lint()`` clean, the graph's code unchanged (the
tag passes only write meta), executable graphs still compute the same outputs, and the
pass-specific invariants hold — or it raises the package's own error and leaves the graph
exactly as it was (same code, same metas).
"""

from __future__ import annotations

import pytest
import torch
from ap_tags import (
    FSDP_AC_GRAPH_ID,
    TagError,
    mark_ac_stages,
    mark_fsdp_all_gather_recomputation,
    node_tag_problems,
    tag_saved_outputs,
    validate_tags,
)
from ap_testing.graphs import snapshot
from ap_testing.joints import RandomJoint, random_joints, run
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.checkpoint import CheckpointPolicy

SAFETY = settings(max_examples=200, deadline=None, derandomize=True, database=None)
P = CheckpointPolicy


Snapshot = tuple[str, object]


def _before(joint: RandomJoint) -> tuple[Snapshot, list[torch.Tensor] | None]:
    """The untransformed graph's snapshot and (when executable) its outputs."""
    outputs = run(joint.gm, joint.inputs) if joint.executable else None
    return snapshot(joint.gm), outputs


def _check_success(joint: RandomJoint, before: tuple[Snapshot, list[torch.Tensor] | None]) -> None:
    joint.gm.graph.lint()
    assert joint.gm.graph.python_code("self").src == before[0][0]
    if before[1] is not None:
        for got, want in zip(run(joint.gm, joint.inputs), before[1], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def _refused(joint: RandomJoint, before: tuple[Snapshot, object], err: Exception) -> None:
    assert isinstance(err, TagError), f"not the package's error: {type(err).__name__}: {err}"
    assert snapshot(joint.gm) == before[0], "a refusing pass modified the graph"


@SAFETY
@given(random_joints(layout="forward", partition_aware=False))
def test_validate_tags_names_exactly_the_bad_nodes(joint: RandomJoint) -> None:
    before = _before(joint)
    try:
        validate_tags(joint.gm)
    except TagError as err:
        _refused(joint, before, err)
        assert set(err.problems) == joint.bad_nodes
        for name in joint.bad_nodes:
            assert name in str(err)
        return
    assert not joint.bad_nodes
    assert snapshot(joint.gm) == before[0]
    _check_success(joint, before)


@SAFETY
@given(random_joints(layout="forward", partition_aware=False), st.booleans())
def test_mark_fsdp_all_gather_recomputation_is_safe(joint: RandomJoint, reshard: bool) -> None:
    before = _before(joint)
    report = mark_fsdp_all_gather_recomputation(joint.gm, reshard_after_forward=reshard)
    _check_success(joint, before)
    assert report.chains_found == joint.fsdp_chains
    nodes = {n.name: n for n in joint.gm.graph.nodes}
    want = P.MUST_RECOMPUTE if reshard else P.MUST_SAVE
    for name in report.tagged_nodes:
        n = nodes[name]
        assert n.op == "call_function"
        assert n.meta["recompute"] is want and n.meta["ac_graph_id"] == FSDP_AC_GRAPH_ID
    for chain in report.chains:
        assert chain.placeholder not in report.tagged_nodes
        if reshard:
            assert chain.all_gather in chain.tagged and set(chain.wait) <= set(chain.tagged)
    # nodes outside the chains keep their tags exactly
    after = dict(snapshot(joint.gm)[1])
    for name, meta in before[0][1]:  # type: ignore[attr-defined]
        if name not in report.tagged_nodes:
            assert after[name] == meta


@SAFETY
@given(random_joints(layout="forward", partition_aware=False))
def test_mark_ac_stages_is_safe(joint: RandomJoint) -> None:
    before = _before(joint)
    try:
        report = mark_ac_stages(joint.gm, stage_size_gib=64 / (1 << 30))
    except TagError as err:
        _refused(joint, before, err)
        assert set(err.problems) <= joint.bad_ac_nodes
        return
    _check_success(joint, before)
    nodes = {n.name: n for n in joint.gm.graph.nodes}
    old = dict(before[0][1])  # type: ignore[call-overload]
    for name in report.user_annotated:  # user SAC regions are never touched
        assert dict(snapshot(joint.gm)[1])[name] == old[name]
    for name in (*report.prefer_recompute, *report.must_save):
        n = nodes[name]
        assert n.op == "call_function"
        assert getattr(n.target, "namespace", None) != "_c10d_functional"
        assert "tangents" not in str(n.args)
        assert n.meta["ac_graph_id"] == FSDP_AC_GRAPH_ID
        assert node_tag_problems(n) == [] or name in joint.bad_nodes


@SAFETY
@given(random_joints(layout="forward", partition_aware=False))
def test_tag_saved_outputs_is_safe(joint: RandomJoint) -> None:
    before = _before(joint)
    try:
        report = tag_saved_outputs(joint.gm, num_fwd_outputs=joint.num_fwd_outputs)
    except TagError as err:
        _refused(joint, before, err)
        assert set(err.problems) <= joint.bad_nodes
        return
    _check_success(joint, before)
    nodes = {n.name: n for n in joint.gm.graph.nodes}
    for name in report.tagged:
        assert nodes[name].meta["custom"]["ap_must_save"] is True
    for parent, indices in report.getitem_parents.items():
        assert set(indices) <= set(nodes[parent].meta["custom"]["ap_must_save_getitem_indices"])
    # the user outputs were not tagged unless they are also saved values
    out = joint.gm.graph.output_node().args[0]
    saved = {v.name for v in out[joint.num_fwd_outputs :]}
    for v in out[: joint.num_fwd_outputs]:
        if v.name in report.tagged:
            assert v.name in saved


_SEEN: set[str] = set()


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(random_joints(layout="forward", partition_aware=False))
def _observe(joint: RandomJoint) -> None:
    targets = {str(n.target) for n in joint.gm.graph.nodes}
    _SEEN.update(t for t in targets if "unbind" in t or "sort" in t or "mm" in t)
    if joint.fsdp_chains:
        _SEEN.add("fsdp")
    if joint.bad_nodes:
        _SEEN.add("bad")
    if joint.executable:
        _SEEN.add("executable")


def test_generator_covers_every_kind() -> None:
    """The generator really produces collectives, multi-output ops, matmuls and invalid tags."""
    _SEEN.clear()
    _observe()
    assert {"fsdp", "bad", "executable"} <= _SEEN
    assert any("unbind" in t for t in _SEEN) and any("sort" in t for t in _SEEN)
    assert any("mm" in t for t in _SEEN)


pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
