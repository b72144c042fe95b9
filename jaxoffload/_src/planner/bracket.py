"""The bracket of a size search: the largest size whose bytes are within a budget.

Pure: the bytes at a size come from a function, a compiled step's in
:func:`~jaxoffload._src.planner.fit.largest_size`, a stand-in in the tests. A
CNN's step holds bytes nearly affine in the batch, and in the pixels, so two
probes predict the answer and a few more bracket it; no size is taken to fit
because its neighbours do.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["largest_fitting"]


def largest_fitting(
    bytes_at: Callable[[int], int],
    budget: int,
    *,
    start: int,
    limit: int,
    multiple_of: int = 1,
    smallest: int = 1,
    tolerance: float = 0.02,
    exponent: float = 1.0,
    out_of_time: Callable[[int], bool] = lambda size: False,
) -> tuple[int, str | None]:
    """The largest multiple of ``multiple_of`` in [``smallest``, ``limit``] whose ``bytes_at`` is within ``budget``.

    Bytes are taken to grow about linearly in ``size ** exponent``. Each probe
    is where the line through the two probes nearest the budget crosses it
    (a secant), kept strictly between the largest size known to fit and the
    smallest above it known not to, else halfway; after a probe that fits,
    the next is a ``tolerance`` above it, which closes the bracket of a step
    whose bytes are affine. The second probe takes the bytes as proportional
    to the size (short of the answer, for affine bytes that fit at the first);
    where they stop growing below the budget, the next probe is an eighth
    above the largest fit rather than a leap; two probes that do not halve the
    bracket are followed by a halving. The search ends when the two are
    ``tolerance`` apart. The answer is always a size that was checked and
    fitted (0 if none was).

    Before each probe but the first, ``out_of_time(size)`` says whether one
    at ``size`` could not finish in the time left; if so the search stops
    there, before it starts, with the bracket that it has.

    Returns:
      ``(size, stopped)``: ``stopped`` says why the search ended early, and
      its bracket (the largest size that fits, the smallest above it that
      does not), if ``out_of_time`` stopped it, else ``None``.

    Example:
      >>> largest_fitting(lambda b: 100 + 10 * b, 1000, start=8, limit=4096)
      (90, None)
    """
    # Sizes in units of multiple_of, from low to top; low - 1 stands for "none fits".
    top, low = limit // multiple_of, max(1, -(-smallest // multiple_of))
    if top < low:
        return 0, None
    seen: dict[int, int] = {}

    def check(unit: int) -> None:
        if unit not in seen:
            seen[unit] = bytes_at(unit * multiple_of)

    first = max(low, min(start // multiple_of, top))
    check(first)
    probe = _proportional(first, seen[first], budget, exponent, tolerance, low, top)
    guessed = False  # whether the probe is the secant's
    widths = []  # the bracket's width after each probe

    def bracket() -> tuple[int, int]:  # the largest unit that fits, the smallest above it over
        good = max((u for u in seen if seen[u] <= budget), default=low - 1)
        return good, min((u for u in seen if seen[u] > budget and u > good), default=top + 1)

    while True:
        # Asked before the compile, not after: one started past the limit overruns it by a
        # compile, the slowest near the budget (docs/design.md, "Sizes that fit").
        if probe not in seen and out_of_time(probe * multiple_of):
            good, bad = bracket()
            above = "nothing above it was checked" if bad > top else f"{bad * multiple_of} does not"
            fits = f"{good * multiple_of} fits" if good >= low else "no size fitted yet"
            return max(0, good * multiple_of) if good >= low else 0, (
                f"stopped at the time limit, before checking {probe * multiple_of}: {fits}, {above}"
            )
        check(probe)
        good, bad = bracket()
        widths.append(bad - good)
        if bad - good <= max(1, int(good * tolerance)):
            return (good * multiple_of if good >= low else 0), None
        step = max(1, int(good * tolerance))
        if guessed and probe == good:  # the guess fitted: a step above closes the bracket
            probe, guessed = good + step, False
        else:
            guess = _secant(seen, good, bad, low, top, budget, exponent)
            guessed = guess is not None and good < guess < bad
            if guessed:
                probe = guess
            elif bad > top:
                # Nothing above is known not to fit, and the bytes stopped growing: the
                # compiler squeezes the step to fit (XLA rematerialises under a device's
                # memory), so the edge is near, and a compile far past it is the slowest.
                probe = min(top, good + max(step, good // 8))
            else:  # just above the largest fit, where the line puts the answer; else halfway
                probe = good + step if guess is not None and guess <= good else (good + bad) // 2
        # Two probes that did not halve the bracket: the line is wrong here (bytes that jump
        # where the compiler stops fitting the step), so halve it.
        slow = len(widths) >= 3 and bad <= top and widths[-1] > widths[-3] / 2
        if slow or not good < probe < bad:
            probe, guessed = (good + bad) // 2, False


def _proportional(first, nbytes, budget, exponent, tolerance, low, top) -> int:
    """The probe after the first: where bytes proportional to ``size ** exponent`` meet the
    budget, at least a ``tolerance`` from the first and at most eight times it.

    Where the first fits, bytes affine in ``size ** exponent`` with a part that does not
    grow (parameters, optimizer state) put the answer beyond this guess, so it does not
    cost a compile past the budget: the slowest kind.
    """
    guess = 8 * first if nbytes <= 0 else int(first * (budget / nbytes) ** (1 / exponent))
    if nbytes <= budget:
        return min(top, max(first + max(1, int(first * tolerance)), min(8 * first, guess)))
    return max(low, min(first - 1, guess))


def _secant(seen, good, bad, low, top, budget, exponent) -> int | None:
    """Where the line through the two probes nearest the budget crosses it (``None``: flat)."""
    fitting = sorted(u for u in seen if seen[u] <= budget)
    over = sorted(u for u in seen if seen[u] > budget)
    pair = (
        (good, bad) if good >= low and bad <= top
        else tuple(fitting[-2:]) if bad > top else tuple(over[:2])
    )  # fmt: skip
    if len(pair) < 2 or seen[pair[1]] == seen[pair[0]]:
        return None
    (x0, y0), (x1, y1) = ((u**exponent, seen[u]) for u in pair)
    x = x0 + (budget - y0) * (x1 - x0) / (y1 - y0)
    return max(low, min(top, int(x ** (1 / exponent)) if x > 0 else low))
