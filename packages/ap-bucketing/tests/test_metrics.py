"""max_consec_compute_between_rs: the longest compute run between reduce-scatters."""

from __future__ import annotations

import torch
from ap_bucketing import max_consec_compute_between_rs
from ap_testing.collectives import GraphBuilder


def test_runs_are_reset_by_reduce_scatters() -> None:
    b = GraphBuilder(dtype=torch.float32)
    x, w = b.placeholder((8, 8)), b.placeholder((8, 8))
    for _ in range(3):
        x = b.mm(b.mm(x, w), w)
        _, x = b.reduce_scatter(x, group_size=1)
        x = b.relu(x)  # pointwise: neutral
    gm = b.module([x])
    assert max_consec_compute_between_rs(gm) == 2
    assert max_consec_compute_between_rs(gm.graph) == 2


def test_leading_and_trailing_runs_count() -> None:
    b = GraphBuilder(dtype=torch.float32)
    x, w = b.placeholder((8, 8)), b.placeholder((8, 8))
    x = b.mm(x, w)
    _, x = b.reduce_scatter(x, group_size=1)
    for _ in range(4):
        x = b.mm(x, w)
    assert max_consec_compute_between_rs(b.module([x])) == 4


def test_no_reduce_scatter_counts_all_compute() -> None:
    b = GraphBuilder(dtype=torch.float32)
    x, w = b.placeholder((8, 8)), b.placeholder((8, 8))
    for _ in range(5):
        x = b.relu(b.mm(x, w))
    assert max_consec_compute_between_rs(b.module([x])) == 5
    assert max_consec_compute_between_rs(GraphBuilder().module([])) == 0
