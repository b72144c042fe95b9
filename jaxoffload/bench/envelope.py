"""What bench points are read against: the Pareto front, and the uniform strategies' envelope."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# The strategies that give one choice to every block, whose points make the envelope that
# plans are judged against: the four the planner's acceptance names.
UNIFORM_STRATEGIES = ("none", "lean", "remat", "offload")


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both coordinates (lower is better).

    Example:
      >>> pareto_front([(1, 5), (2, 2), (3, 3), (4, 1)])
      [0, 1, 3]
    """
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any(
            (u <= x and v <= y) and (u, v) != (x, y) for j, (u, v) in enumerate(points) if j != i
        )
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i])


def envelope_step(points: Sequence[tuple[float, float]], budget: float) -> float | None:
    """The least step that the uniform strategies' points reach within a memory budget.

    A plan mixes strategies block by block, so it should be as fast as any uniform
    point that fits, and as the straight line between two points, which a mix of
    their two strategies approaches. The envelope is the lower convex hull of the
    points that no other beats (:func:`pareto_front`), step as a function of memory;
    at ``budget`` it is the lesser of the fastest point within the budget and the
    hull's segment that brackets the budget.

    Args:
      points: ``(memory, step)`` of each uniform strategy (:data:`UNIFORM_STRATEGIES`),
        in any units.
      budget: memory, in the points' unit.

    Returns:
      The least step at ``budget``, or ``None`` if no point's memory is within it.

    Example:
      >>> points = [(4, 48), (6, 50), (7, 46), (10, 40)]  # (4, 48) beats (6, 50)
      >>> envelope_step(points, 7)  # the line from (4, 48) to (10, 40) beats (7, 46)
      44.0
      >>> envelope_step(points, 12), envelope_step(points, 3)
      (40, None)
    """
    fitting = [step for memory, step in points if memory <= budget]
    if not fitting:
        return None
    hull = _lower_hull(sorted({points[i] for i in pareto_front(points)}))
    # Undominated and distinct, the hull's points have distinct memories: no segment is vertical.
    lines = [
        s0 + (s1 - s0) * (budget - m0) / (m1 - m0)
        for (m0, s0), (m1, s1) in zip(hull, hull[1:])
        if m0 <= budget <= m1
    ]
    return min(fitting + lines)


def _lower_hull(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The lower convex hull of ``points``, sorted by memory (Andrew's monotone chain)."""
    hull: list[tuple[float, float]] = []
    for m, s in points:
        # Drop the last point while it is not below the segment from the one before it to (m, s).
        while len(hull) >= 2:
            (m0, s0), (m1, s1) = hull[-2], hull[-1]
            if (m1 - m0) * (s - s0) - (s1 - s0) * (m - m0) > 0:
                break
            hull.pop()
        hull.append((m, s))
    return hull


def uniform_points(records: Sequence[Any], key: str) -> dict[str, tuple[float, float]]:
    """``(memory at key, step)`` of each measured strategy of :data:`UNIFORM_STRATEGIES`,
    from records (:class:`jaxoffload.bench.record.Record`): ``key`` names their memory field."""
    return {
        r.strategy: (getattr(r, key), r.step_time_ms)
        for r in records
        if r.strategy in UNIFORM_STRATEGIES and r.step_time_ms is not None and getattr(r, key)
    }
