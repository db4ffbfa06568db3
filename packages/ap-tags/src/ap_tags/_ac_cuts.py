"""Where staged activation checkpointing cuts the forward: pure functions over byte counts.

The forward's savable values are a sequence; value ``i`` has ``sizes[i]`` bytes and, at its
position, ``alive[i]`` bytes of savable values are live (what resuming the forward there needs).
A *cut* at ``i`` saves those live bytes; the backward then recomputes each *segment* between two
cuts from the earlier cut's saved values. During the backward, the saved bytes of every cut are
held while one segment is recomputed, so the peak AC adds is about
``sum(alive at cuts) + largest segment``.

* A fixed stage size (``stage_cuts`` + ``least_alive_points``): consecutive stages of about that
  many bytes, one cut per stage at its least-alive point.
* ``"auto"`` (``auto_cut_points``): the cuts that minimise the peak above, among the narrow
  points of the forward (``narrow_points``). A fixed unit such as
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


def _cheapest_cuts(
    prefix: list[int], alive: list[int], candidates: list[int], limit: int
) -> tuple[int, list[int]] | None:
    """The cuts, among ``candidates`` (increasing positions), of least total ``alive`` such that
    no segment holds more than ``limit`` bytes; ``None`` when no choice of them does.

    ``prefix[k]`` is the bytes of values ``0..k-1``. Dynamic programme over the last cut, with a
    sliding-window minimum (the earliest feasible previous cut only moves forward): O(n).
    """
    n = len(prefix) - 1
    best: dict[int, int] = {-1: 0}  # least cost of cuts ending with a cut at i; -1 = the start
    parent: dict[int, int] = {}
    window: deque[int] = deque([-1])  # feasible previous cuts, increasing cost

    def drop_far(end: int) -> bool:
        while window and prefix[end + 1] - prefix[window[0] + 1] > limit:
            window.popleft()
        return bool(window)

    for i in candidates:
        if not drop_far(i):
            return None
        best[i] = alive[i] + best[window[0]]
        parent[i] = window[0]
        while window and best[window[-1]] >= best[i]:
            window.pop()
        window.append(i)
    if not drop_far(n - 1):
        return None
    last = window[0]
    total = best[last]
    points = []
    while last >= 0:
        points.append(last)
        last = parent[last]
    return total, points[::-1]


def _largest_segment(prefix: list[int], points: list[int]) -> int:
    bounds = [-1, *points, len(prefix) - 2]
    return max(prefix[b + 1] - prefix[a + 1] for a, b in zip(bounds, bounds[1:], strict=False))


def narrow_points(alive: list[int]) -> list[int]:
    """Where ``"auto"`` may cut: where at most twice the forward's narrowest bytes are alive.

    The narrowest point is taken in the middle half of the forward (a transformer's residual
    stream between blocks; the ends are the inputs and the loss). Cutting at a wide point would
    save a large activation to spare recomputing the segment behind it -- the trade min-cut
    already makes without AC; a cut at a head's ``[tokens, vocab]`` logits (4.2 GB at LLaMA-3
    8B's shapes) saved more than the whole partition without AC.
    """
    if not alive:
        return []
    quarter = len(alive) // 4
    middle = alive[quarter : len(alive) - quarter] or alive
    narrow = 2 * min(middle)
    return [i for i, a in enumerate(alive) if a <= narrow]


def auto_cut_points(sizes: list[int], alive: list[int]) -> tuple[int, list[int]]:
    """``(largest segment bytes, cut positions)`` minimising saved bytes + largest segment,
    with cuts only at ``narrow_points``. ``sizes`` are what recomputing each value materialises
    (the caller's estimate), ``alive`` what a cut there saves.

    Tries segment-size limits on a geometric grid from the largest value to the total and keeps
    the cheapest peak (fewer saved bytes on a tie).
    """
    if not sizes:
        return 0, []
    candidates = narrow_points(alive)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    total = prefix[-1]
    if not total:
        return 0, []
    limit = max(1, max(sizes))
    chosen: tuple[int, int, int, list[int]] = (total, 0, total, [])  # peak, saved, segment, cuts
    while limit < total:
        found = _cheapest_cuts(prefix, alive, candidates, limit)
        if found is not None:
            saved, points = found
            segment = _largest_segment(prefix, points)
            if (saved + segment, saved) < chosen[:2]:
                chosen = (saved + segment, saved, segment, points)
        limit = max(limit + 1, int(limit * _LIMIT_STEP))
    return chosen[2], chosen[3]
