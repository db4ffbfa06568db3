"""Where staged AC cuts the forward (``ap_tags._ac_cuts``), checked against brute force."""

from __future__ import annotations

import itertools
import random

import pytest
from ap_tags._ac_cuts import (
    _cheapest_cuts,
    _largest_segment,
    auto_cut_points,
    least_alive_points,
    narrow_points,
    stage_cuts,
)


def _prefix(sizes: list[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def _all_cut_sets(n: int) -> list[list[int]]:
    return [list(c) for k in range(n + 1) for c in itertools.combinations(range(n), k)]


def _cases(count: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(0)
    out = []
    for _ in range(count):
        n = rng.randint(1, 9)
        sizes = [rng.choice([0, 1, 2, 4, 8, 16]) for _ in range(n)]
        alive = [rng.randint(0, 20) for _ in range(n)]
        out.append((sizes, alive))
    return out


def _subsets(points: list[int]) -> list[list[int]]:
    return [list(c) for k in range(len(points) + 1) for c in itertools.combinations(points, k)]


@pytest.mark.parametrize("case", range(60))
def test_cheapest_cuts_is_exact_for_each_limit(case: int) -> None:
    sizes, alive = _cases(60)[case]
    prefix = _prefix(sizes)
    rng = random.Random(case)
    candidates = sorted(rng.sample(range(len(sizes)), rng.randint(0, len(sizes))))
    for limit in sorted({1, *prefix[1:]}):
        found = _cheapest_cuts(prefix, alive, candidates, limit)
        feasible = [
            sum(alive[p] for p in cuts)
            for cuts in _subsets(candidates)
            if _largest_segment(prefix, cuts) <= limit
        ]
        if not feasible:
            assert found is None, (sizes, candidates, limit)
            continue
        assert found is not None, (sizes, candidates, limit)
        saved, points = found
        assert points == sorted(set(points)) and set(points) <= set(candidates)
        assert saved == sum(alive[p] for p in points)
        assert _largest_segment(prefix, points) <= limit
        assert saved == min(feasible), (sizes, alive, candidates, limit)


@pytest.mark.parametrize("case", range(60))
def test_auto_cut_points_is_within_the_limit_grid_of_the_best_peak(case: int) -> None:
    """Among the narrow points, the peak found is at most 1.1x the true optimum (the limit
    grid steps by 1.1x)."""
    sizes, alive = _cases(60)[case]
    narrow = narrow_points(alive)
    prefix = _prefix(sizes)
    segment, points = auto_cut_points(sizes, alive)
    assert segment == _largest_segment(prefix, points)
    assert set(points) <= set(narrow_points(alive))
    peak = sum(alive[p] for p in points) + segment
    best = min(
        sum(alive[p] for p in cuts) + _largest_segment(prefix, cuts) for cuts in _subsets(narrow)
    )
    assert best <= peak <= 1.1 * best + 1, (sizes, alive)


def test_auto_cuts_every_block_at_its_narrow_point() -> None:
    """Four identical blocks: wide values, then a narrow residual. Each block is cut at its
    residual, the same way in every block; one stage (no cut) would hold the whole forward."""
    block_sizes, block_alive = [64, 64, 64, 8], [70, 130, 130, 8]
    sizes, alive = block_sizes * 4, block_alive * 4
    segment, points = auto_cut_points(sizes, alive)
    assert [p % 4 for p in points] == [3] * len(points)
    assert len(points) >= 2 and segment < sum(sizes)


def test_auto_never_cuts_a_wide_head() -> None:
    """Blocks with a narrow residual, then a head whose values are 50x wider (logits): cutting
    at the head would shorten the last segment, but saves more than it spares."""
    sizes = [64, 64, 8] * 4 + [400, 400, 400, 400]
    alive = [70, 130, 8] * 4 + [400, 800, 800, 400]
    _, points = auto_cut_points(sizes, alive)
    assert points and all(p < 12 and p % 3 == 2 for p in points)
    assert narrow_points(alive) == [2, 5, 8, 11]


def test_fixed_stages_cut_at_their_least_alive_point() -> None:
    stages = stage_cuts([4, 4, 4, 4, 4], 8)
    assert stages == [(0, 2), (2, 4), (4, 5)]
    assert least_alive_points([9, 9, 1, 5, 3], stages) == [1, 2, 4]  # ties: the later one


def test_nothing_to_cut() -> None:
    assert auto_cut_points([], []) == (0, [])
