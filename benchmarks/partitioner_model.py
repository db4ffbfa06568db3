"""The partitioner benchmark's model and its two compilations.

The model is ap-testing's FSDP-style ``Transformer`` at dim 128 with a 4x MLP: parameters are
dim-0 shards all-gathered in forward with autograd-aware functional collectives on the fake
process group (world size 8), so the graphs are real and the data is garbage: only structure
and times are measured. The compilations are ap-testing's ``two_stage``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ap_tags
import torch
from ap_partitioner import PartitionReport, report_for
from ap_testing import two_stage
from ap_testing.distributed import fake_world
from ap_testing.models import Transformer
from ap_testing.two_stage import CapturedJoint

__all__ = ["CapturedJoint", "FirstCompile", "fake_process_group", "first_compile", "second_compile"]

#: The fake process group for a block (world size 8); ``benchmarks.memory`` uses it too.
fake_process_group = fake_world


@dataclass
class FirstCompile:
    """The first compilation and the report of its partition (torch's ``default_partition``)."""

    first: two_stage.First
    report: PartitionReport


def first_compile(layers: int, *, seq: int = 64, dim: int = 128) -> FirstCompile:
    """Export, tag FSDP chains MUST_RECOMPUTE, ``default_partition``, tagging interpreter."""
    torch.manual_seed(0)
    model = Transformer(layers, dim, heads=4, ffn_mult=4)
    first = two_stage.first_compile(model, torch.randn(2, seq, dim))
    report = report_for(first.fw, first.bw, first.num_fwd_outputs, partitioner="first")
    return FirstCompile(first, report)


def second_compile(
    first: FirstCompile,
    partitioner: Any,
    *,
    ac: bool,
    capture: list[CapturedJoint] | None = None,
) -> None:
    """``torch.compile`` the first callable (identity compilers, ``partitioner``), with ap-tags'
    AC staging joint pass when ``ac``; ``capture`` receives every joint graph partitioned."""
    joint_pass = ap_tags.ac_joint_pass("auto") if ac else None
    two_stage.second_compile(first.first, partitioner, joint_pass=joint_pass, capture=capture)
