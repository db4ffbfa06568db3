"""Where staged activation checkpointing cuts the forward: pure functions over byte counts.

The forward's savable values are a sequence; value ``i`` has ``sizes[i]`` bytes and, at its
position, ``alive[i]`` bytes of savable values are live (what resuming the forward there needs).
A *cut* at ``i`` saves those live bytes; the backward then recomputes each *segment* between two
cuts from the earlier cut's saved values. During the backward, the saved bytes of every cut are
held while one segment is recomputed, so the peak AC adds is about
``sum(alive at cuts) + largest segment``.

* A fixed stage size (``stage_cuts`` + ``least_alive_points``): consecutive stages of about that
  many bytes, one cut per stage at its least-alive point.
* ``"auto"`` (``auto_cut_points``): the cuts that minimise the peak above. A fixed unit such as
  ``sqrt(total GiB)`` GiB leaves any forward under 1 GiB in one stage: the backward recomputes
  the whole forward from the inputs before its first op, which lowers nothing at the peak, and
  each layer's recomputation then fuses into its backward differently (more distinct kernels to
  compile). Minimising the peak instead cuts where little is alive -- a transformer's residual
  stream between blocks -- the same way in every layer.
"""

from __future__ import annotations

from collections import deque

_LIMIT_STEP = 1.1  # the grid of segment-size limits ``auto_cut_points`` tries, geometric


def stage_cuts(sizes: list[int], stage_bytes: int) -> list[tuple[int, int]]:
    """Split positions ``0..len(sizes)`` into consecutive ``[start, end)`` stages by bytes."""
    cuts: list[tuple[int, int]] = []
    start, acc = 0, 0
    for i, size in enumerate(sizes):
        acc += size
        if acc >= stage_bytes:
            cuts.append((start, i + 1))
            start, acc = i + 1, 0
    if start < len(sizes) and acc > 0:
        cuts.append((start, len(sizes)))
    return cuts


def least_alive_points(alive: list[int], stages: list[tuple[int, int]]) -> list[int]:
    """One cut per stage: its position with the fewest live bytes (the later one on a tie)."""
    return [min(range(start, end), key=lambda i: (alive[i], -i)) for start, end in stages]


def _cheapest_cuts(prefix: list[int], alive: list[int], limit: int) -> tuple[int, list[int]]:
    """The cuts of least total ``alive`` such that no segment holds more than ``limit`` bytes.

    ``prefix[k]`` is the bytes of values ``0..k-1``. Dynamic programme over the last cut, with a
    sliding-window minimum (the earliest feasible previous cut only moves forward): O(n).
    ``limit`` must be at least the largest single value, so one cut per value is feasible.
    """
    n = len(alive)
    best = [0] * n  # least cost of cuts ending with a cut at i
    parent = [-1] * n
    window: deque[int] = deque([-1])  # candidate previous cuts, increasing cost; -1 = the start

    def cost(j: int) -> int:
        return 0 if j < 0 else best[j]

    for i in range(n):
        while prefix[i + 1] - prefix[window[0] + 1] > limit:
            window.popleft()
        best[i] = alive[i] + cost(window[0])
        parent[i] = window[0]
        while window and cost(window[-1]) >= best[i]:
            window.pop()
        window.append(i)
    while prefix[n] - prefix[window[0] + 1] > limit:
        window.popleft()
    last = window[0]
    total = cost(last)
    points = []
    while last >= 0:
        points.append(last)
        last = parent[last]
    return total, points[::-1]


def _largest_segment(prefix: list[int], points: list[int]) -> int:
    bounds = [-1, *points, len(prefix) - 2]
    return max(prefix[b + 1] - prefix[a + 1] for a, b in zip(bounds, bounds[1:], strict=False))


def auto_cut_points(sizes: list[int], alive: list[int]) -> tuple[int, list[int]]:
    """``(largest segment bytes, cut positions)`` minimising saved bytes + largest segment.

    Tries segment-size limits on a geometric grid from the largest value to the total and keeps
    the cheapest peak (fewer saved bytes on a tie).
    """
    if not sizes:
        return 0, []
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    total = prefix[-1]
    limit = max(1, max(sizes))
    chosen: tuple[int, int, int, list[int]] = (total, 0, total, [])  # peak, saved, segment, cuts
    while True:
        saved, points = _cheapest_cuts(prefix, alive, limit)
        segment = _largest_segment(prefix, points)
        key = (saved + segment, saved, segment, points)
        if key[:2] < chosen[:2]:
            chosen = key
        if limit >= total:
            break
        limit = min(total, max(limit + 1, int(limit * _LIMIT_STEP)))
    return chosen[2], chosen[3]
