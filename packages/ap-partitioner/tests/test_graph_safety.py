"""Graph safety: SaveAllPartitioner over random joint graphs with random (valid/invalid) tags.

Property: the partitioner either returns a forward/backward pair that lints clean and — when
the joint graph is executable (no collectives) — computes the same forward outputs and the
same gradients as the joint graph itself; or (``strict=True`` only) it raises its own error
(``ReplayError`` / ``ap_tags.TagError``) and leaves the joint graph exactly as it was.
Non-strict calls never raise: bad tags and invalid cuts fall back to min-cut, with the report
saying so.
"""

from __future__ import annotations

from collections.abc import Iterator

import ap_tags
import pytest
import torch
from ap_partitioner import PartitionReport, ReplayError, SaveAllPartitioner
from ap_tags.scoped import quiet_logger
from ap_testing.graphs import snapshot
from ap_testing.joints import RandomJoint, random_joints, run, run_partition
from hypothesis import given, settings
from hypothesis import strategies as st

SAFETY = settings(max_examples=200, deadline=None, derandomize=True, database=None)


@pytest.fixture(autouse=True)
def _quiet_fallback_warnings() -> Iterator[None]:
    """Fallback warnings are expected here by the hundred."""
    with quiet_logger("ap_partitioner"):
        yield


@SAFETY
@given(random_joints(layout="joint"), st.booleans())
def test_save_all_partitioner_is_safe(joint: RandomJoint, strict: bool) -> None:
    before = snapshot(joint.gm)
    expected = run(joint.gm, joint.inputs) if joint.executable else None
    reports: list[PartitionReport] = []
    partitioner = SaveAllPartitioner(strict=strict, on_report=reports.append)
    try:
        fw, bw = partitioner(joint.gm, joint.inputs, num_fwd_outputs=joint.num_fwd_outputs)
    except (ReplayError, ap_tags.TagError) as err:
        assert strict, f"non-strict SaveAll raised instead of falling back: {err}"
        assert snapshot(joint.gm) == before, "a refusing partitioner modified the joint graph"
        if isinstance(err, ap_tags.TagError):
            assert set(err.problems) <= joint.bad_nodes
        return
    fw.graph.lint()
    bw.graph.lint()
    (report,) = reports
    if joint.bad_nodes:
        assert report.fell_back and "malformed tags" in (report.fallback_reason or "")
    if report.fell_back:
        assert not strict and report.fallback_reason
    if expected is not None:
        fw_out, grads = run_partition(fw, bw, joint)
        want_fw = expected[: joint.num_fwd_outputs]
        want_bw = expected[joint.num_fwd_outputs :]
        for got, want in zip(fw_out, want_fw, strict=True):
            torch.testing.assert_close(got, want)
        for got, want in zip(grads, want_bw, strict=True):
            torch.testing.assert_close(got, want)


_SEEN: set[str] = set()


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(random_joints(layout="joint"))
def _observe(joint: RandomJoint) -> None:
    reports: list[PartitionReport] = []
    SaveAllPartitioner(on_report=reports.append)(
        joint.gm, joint.inputs, num_fwd_outputs=joint.num_fwd_outputs
    )
    _SEEN.add("fell_back" if reports[0].fell_back else "replayed")
    if reports[0].fallback_reason and "not a valid cut" in reports[0].fallback_reason:
        _SEEN.add("invalid_cut")
    if joint.fsdp_chains:
        _SEEN.add("collectives")
    if reports[0].saved_activation_count:
        _SEEN.add("saved_activations")


def test_generator_exercises_replay_fallback_and_collectives() -> None:
    _SEEN.clear()
    _observe()
    assert {"fell_back", "replayed", "collectives", "saved_activations"} <= _SEEN
