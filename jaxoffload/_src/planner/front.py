"""The front of a model's plans: for every memory target, the fastest choice of one option per block.

Each block has options, each with the device bytes it keeps between the two
passes and the milliseconds it adds to the step. Choosing one per block so
that the bytes fit a target at the least total time is a multiple-choice
knapsack; :func:`front` solves it exactly, by dynamic programming over bytes
counted in ``resolution`` steps, for every target at once. The planner then
checks its candidates against the compiled program, which alone says what a
plan really holds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

__all__ = ["Option", "Point", "front"]


@dataclasses.dataclass(frozen=True)
class Option:
    """One way for a block to run, and what it costs.

    Attributes:
      strategy: the strategy value.
      kept_bytes: the device bytes it keeps from its forward pass to its backward pass.
      ms: the time of its forward and backward passes, with the transfers that
        compute cannot hide.
      moved_bytes: the bytes it moves to the host and back.
    """

    strategy: Any
    kept_bytes: int
    ms: float
    moved_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Point:
    """One choice on the front: an option index per block, and its totals."""

    choice: tuple[int, ...]
    kept_bytes: int
    ms: float


def front(blocks: Sequence[Sequence[Option]], resolution: int = 512) -> list[Point]:
    """The fastest choice for each of ``resolution + 1`` byte targets, leanest first, deduplicated.

    Bytes are rounded up to steps of ``max_total / resolution``, so a choice
    said to fit a target does; ties in time go to the choice that keeps less.
    Every point returned is faster than every point before it, and keeps
    more: the points are the front, from the leanest choice to the fastest.

    Example:
      >>> a = [Option("store", 100, 1.0), Option("remat", 10, 1.5)]
      >>> [p.choice for p in front([a, a], resolution=20)]
      [(1, 1), (1, 0), (0, 0)]
    """
    if not blocks or any(not options for options in blocks):
        raise ValueError("every block needs at least one option.")
    most = sum(max(o.kept_bytes for o in options) for options in blocks)
    unit = max(1.0, most / resolution)
    steps = [[math.ceil(o.kept_bytes / unit) for o in options] for options in blocks]
    capacity = sum(max(s) for s in steps)
    # best[c]: the least time of the blocks so far in at most c steps; pick[b][c]: block b's option.
    best = [0.0] * (capacity + 1)
    picks = []
    for options, weights in zip(blocks, steps):
        new, pick = [math.inf] * (capacity + 1), [-1] * (capacity + 1)
        for c in range(capacity + 1):
            for k, (option, w) in enumerate(zip(options, weights)):
                if w <= c and best[c - w] + option.ms < new[c]:
                    new[c], pick[c] = best[c - w] + option.ms, k
        best, picks = new, [*picks, pick]
    points: list[Point] = []
    for c in range(capacity + 1):
        if best[c] == math.inf:
            continue
        choice, left = [], c
        for b in reversed(range(len(blocks))):
            k = picks[b][left]
            choice.append(k)
            left -= steps[b][k]
        choice = tuple(reversed(choice))
        kept = sum(blocks[b][k].kept_bytes for b, k in enumerate(choice))
        ms = sum(blocks[b][k].ms for b, k in enumerate(choice))
        points.append(Point(choice, kept, ms))
    # Rounding can find a leaner choice at a larger target: keep those no other beats on both.
    points.sort(key=lambda p: (p.kept_bytes, p.ms))
    frontier: list[Point] = []
    for p in points:
        if not frontier or p.ms < frontier[-1].ms:
            frontier.append(p)
    return frontier
