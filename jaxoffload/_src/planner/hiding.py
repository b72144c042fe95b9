"""The host link as one timeline: which copies the compute can hide, and what the others cost.

A step's host copies share one link each way, so whether a block's copies hide depends on
the copies of the blocks before it, not only on the compute after it. Both functions here
follow the link through a step, block by block, as an ``Offload`` chain orders it
(:class:`~jaxoffload._src.transfers.Chain`): a block's copies to the host start once it has
run and the link is free, and the outputs of the block ``window - 1`` later wait for them;
in the backward pass, its fetch starts once the block ``fetch_window - 1`` later starts its
backward pass and the link is free, and its own backward pass waits for it.

- :func:`hidden_copies` chooses, per block, what moves and the windows, so that every copy
  runs while blocks compute: the copies to the host are done by the end of the forward pass,
  where the peak is, and each fetch arrives just before its block's backward pass needs it,
  so that fetched residuals are held no longer than the link requires.
- :func:`copy_timeline` gives a plan's forward and backward time with its copies: the
  compute, and the waits for copies that it could not hide.

``docs/design.md`` ("Copies that hide") has what the H200 did with such schedules.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from jaxoffload._src.strategies import Offload

__all__ = ["HiddenCopies", "copy_timeline", "hidden_copies"]

# The share of the link's measured speed that a schedule counts on. On the H200, copies
# under compute ran at the speed measured alone (design §13), so the whole link.
LINK_SHARE = 1.0
# What a block moves, at the least, of the residuals it may move (see hidden_copies).
LEAST_SHARE = 0.05


@dataclasses.dataclass(frozen=True)
class HiddenCopies:
    """One block's copies in a schedule that hides them: ``Offload``'s fields, and where they run.

    Attributes:
      moved: the bytes that move each way: ``Offload``'s ``max_bytes``, which moves
        exactly these residuals.
      window: ``Offload``'s ``window``: the outputs of the block ``window - 1`` later wait
        for the copies to the host.
      fetch_window: ``Offload``'s ``fetch_window``: the fetch starts when the block
        ``fetch_window - 1`` later starts its backward pass.
      to_host_ms: when the copies to the host start and end, in ms from the forward pass's
        start.
      fetch_ms: when the fetch starts and ends, in ms from the backward pass's start.
    """

    moved: int
    window: int
    fetch_window: int
    to_host_ms: tuple[float, float]
    fetch_ms: tuple[float, float]


def hidden_copies(
    forward_ms: Sequence[float],
    backward_ms: Sequence[float],
    sizes: Sequence[Sequence[int]],
    link: tuple[float, float],
    *,
    link_share: float = LINK_SHARE,
    least_share: float = LEAST_SHARE,
) -> list[HiddenCopies | None]:
    """Per block, the largest copies that run while blocks compute, with their windows.

    The blocks are taken in call order. Each block's copies to the host start when it has
    run and the copies before it are done, and the block ``window - 1`` later waits for them.
    They take the block's largest residuals that fit, as ``Offload(max_bytes=...)`` chooses
    them, so that the copies free device memory at the peak, at the turn to the backward
    pass: they must be done by the turn, and while a copy is still running its residuals stay
    on the device, so at the end of every block the blocks after it must keep at least what
    is still in flight (each block keeps what it may move). Otherwise the peak falls only by
    what those later blocks keep (``docs/design.md``, "Copies that hide"). The first blocks,
    with the most compute and the most kept bytes after them, move the most. The window is
    the fewest blocks whose compute covers the copies. Each fetch then ends when
    its block's backward pass starts, or when the fetch after it on the link starts, and
    starts with the backward pass of the block ``fetch_window - 1`` later; a fetch that
    would have to start before the backward pass does moves less.

    Args:
      forward_ms: each block's forward pass, in call order.
      backward_ms: each block's backward pass.
      sizes: the residuals each block may move (an ``Offload``'s), in bytes.
      link: ``(d2h_gbps, h2d_gbps)``, the link's measured speed each way, in 10⁹ bytes/s.
      link_share: the share of that speed that the schedule counts on.
      least_share: a block that would move less than this share of its residuals moves
        nothing: a cap below every large residual moves only crumbs (a BatchNorm's
        statistics), and their copies and call boundary buy nothing.

    Returns:
      One entry per block: its :class:`HiddenCopies`, or ``None`` where nothing can hide.

    Example:
      >>> mb = 10**6
      >>> copies = hidden_copies([1, 1, 1, 1], [2, 2, 2, 2], [[60 * mb, 20 * mb]] * 4, (50, 50))
      >>> [(c.moved // mb, c.window, c.fetch_window) for c in copies if c]
      [(80, 3, 2), (60, 3, 2)]
    """
    n = len(forward_ms)
    if not (len(backward_ms) == len(sizes) == n):
        raise ValueError(
            f"forward_ms, backward_ms and sizes need one entry per block; got {n}, "
            f"{len(backward_ms)} and {len(sizes)}."
        )
    if not 0 < link_share <= 1:
        raise ValueError(f"link_share must be in (0, 1], got {link_share!r}.")
    out_rate, back_rate = (g * 1e6 * link_share for g in link)  # bytes per ms
    if not (out_rate > 0 and back_rate > 0):
        raise ValueError(f"link must be two positive speeds in GB/s, got {link!r}.")
    ends = list(itertools.accumulate(forward_ms))  # each block's forward pass ends
    turn = ends[-1] if n else 0.0
    starts_back = _after(backward_ms)  # each block's backward pass starts

    least = [least_share * sum(s) for s in sizes]

    # Copies to the host, in call order: each as large as the time left before the turn,
    # and as what the blocks after each block still running it keep.
    kept_after = _after([sum(s) for s in sizes])
    in_flight = [0] * n  # bytes whose copies still run when each block ends
    moved = [0] * n
    free = 0.0
    for i in range(n):
        start = max(ends[i], free)
        cap = (turn - start) * out_rate
        while (m := _largest_under(sizes[i], cap)) > 0:
            # Until the block that waits for it has run, the copy holds its bytes here.
            waiting = _waiting_block(ends, i, start + m / out_rate)
            room = min((kept_after[g] - in_flight[g] for g in range(i, waiting)), default=m)
            if m <= room:
                break
            cap = m - 1  # the next smaller choice, which ends sooner
        if m and m >= least[i]:
            moved[i] = m
            free = start + m / out_rate
            for g in range(i, waiting):
                in_flight[g] += m

    # Fetches, from the one needed last: each ends as late as the link allows.
    fetches: list[tuple[float, float]] = [(0.0, 0.0)] * n
    link_from = float("inf")  # the link is busy from here on, with fetches needed later
    for i in range(n):
        end = min(starts_back[i], link_from)
        moved[i] = _largest_under(sizes[i], min(moved[i], end * back_rate))
        if moved[i] and moved[i] >= least[i]:
            fetches[i] = (end - moved[i] / back_rate, end)
            link_from = fetches[i][0]
        else:
            moved[i] = 0

    # The copies to the host again, with what the fetches left: their times and windows.
    result: list[HiddenCopies | None] = [None] * n
    free = 0.0
    for i in range(n):
        if not moved[i]:
            continue
        start = max(ends[i], free)
        free = start + moved[i] / out_rate
        # The fewest blocks whose compute covers the copies, and the latest backward pass
        # that starts the fetch in time.
        window = _waiting_block(ends, i, free) - i + 1
        fetch_window = next(
            (f for f in range(1, n - i) if starts_back[i + f - 1] <= fetches[i][0]), n - i
        )
        result[i] = HiddenCopies(moved[i], window, fetch_window, (start, free), fetches[i])
    return result


def copy_timeline(
    forward_ms: Sequence[float],
    backward_ms: Sequence[float],
    moved: Sequence[int],
    windows: Sequence[int],
    fetch_windows: Sequence[int],
    link: tuple[float, float],
) -> tuple[float, float]:
    """``(forward, backward)``: a plan's two passes in ms, with the waits for its copies.

    Copies take the link one at a time, in the order the chain starts them: a block's copies
    to the host when it has run; its fetch when the block ``fetch_window - 1`` later starts
    its backward pass. A block waits where the chain makes it wait: the outputs of the block
    ``window - 1`` later, for the copies to the host; a block's backward pass, for its fetch.
    The last copies to the host, which no later block waits for, end the forward pass.

    Args:
      forward_ms, backward_ms: each block's passes, in call order, without transfers.
      moved: the bytes each block moves each way.
      windows, fetch_windows: each block's ``Offload`` windows (anything for a block that
        moves nothing).
      link: ``(d2h_gbps, h2d_gbps)``.

    Example:
      >>> copy_timeline([1, 1], [2, 2], [100 * 10**6, 0], [1, 1], [1, 1], (50, 50))
      (4.0, 6.0)
    """
    n = len(forward_ms)
    out_rate, back_rate = (g * 1e6 for g in link)
    waits: dict[int, float] = {}  # block -> when its outputs may leave
    clock = free = 0.0
    for i in range(n):
        if moved[i]:
            # Its copies start as it ends; the block window - 1 later waits for them.
            end = clock + forward_ms[i]
            start = max(end, free)
            free = start + moved[i] / out_rate
            gate = min(i + windows[i] - 1, n - 1)
            waits[gate] = max(waits.get(gate, 0.0), free)
        clock = max(clock + forward_ms[i], waits.get(i, 0.0))
    forward = max(clock, free)

    starting: dict[int, list[int]] = {}  # block -> the fetches its backward pass starts
    for i in reversed(range(n)):  # the one needed first first
        if moved[i]:
            starting.setdefault(min(i + fetch_windows[i] - 1, n - 1), []).append(i)
    arrived: dict[int, float] = {}  # block -> when its fetch is done
    clock = link_from = 0.0
    for j in reversed(range(n)):
        for i in starting.get(j, ()):
            start = max(clock, link_from)
            link_from = arrived[i] = start + moved[i] / back_rate
        clock = max(clock, arrived.get(j, 0.0)) + backward_ms[j]
    return forward, clock


def _waiting_block(ends: Sequence[float], i: int, done: float) -> int:
    """The first block from ``i`` on whose forward pass ends once a copy is ``done``: the one
    that waits for it (the last block, at worst)."""
    return next((g for g in range(i, len(ends)) if ends[g] >= done), len(ends) - 1)


def _largest_under(sizes: Sequence[int], cap: float) -> int:
    """The bytes that ``Offload(max_bytes=cap)`` moves of residuals of ``sizes``."""
    sizes = tuple(int(s) for s in sizes)
    go = Offload(max_bytes=max(0, int(cap))).moved(sizes)
    return sum(s for s, g in zip(sizes, go) if g)


def _after(values: Sequence[float]) -> list[float]:
    """Per block, the sum of the values of the blocks after it: of their backward passes, when
    its own starts (the last block's first); of their kept bytes, what the peak holds after it."""
    n, total, out = len(values), 0.0, [0.0] * len(values)
    for j in reversed(range(n)):
        out[j] = total
        total += values[j]
    return out
