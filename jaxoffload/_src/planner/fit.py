"""The largest batch or image size whose training step fits a device budget.

Each probed size's step is compiled, allocating nothing, and its device bytes
(``memory_analysis()``: arguments and temporaries) are compared with the
budget. A CNN's step holds bytes nearly affine in the batch, and in the
pixels, so two compiles predict the answer and a few more bracket it
(:mod:`~jaxoffload._src.planner.bracket`). No size is taken to fit because its
neighbours do: compiled bytes need not be monotone in the size, so the answer
is a size that was compiled and fitted, and one real step there confirms it by
the runtime peak.

A search answers within its time limit: a compile that the ones before it say
would not finish in the time left is not started, and the search answers with
its bracket instead. Nor is a step compiled whose outcome is known: with
``plan=True``, the plain step past a size where it compiled over the budget.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxoffload._src import checks
from jaxoffload._src.jaxprs import format_bytes
from jaxoffload._src.planner.arguments import (
    check_donated,
    check_min_speed,
    check_planning,
    check_search,
    check_takes,
)
from jaxoffload._src.planner.bracket import largest_fitting
from jaxoffload._src.planner.budget import check_room, device_budget
from jaxoffload._src.planner.messages import progress_printer
from jaxoffload._src.planner.plan import Plan
from jaxoffload._src.planner.size_steps import SizeSteps

__all__ = ["Fit", "largest_size"]


@dataclasses.dataclass(frozen=True)
class Fit:
    """The largest size found, and the step there; ``str(fit)`` says it in one line.

    Attributes:
      size: the largest size whose step fits (0 if not even the smallest does).
      budget_bytes: the budget, in device bytes.
      compiled_bytes: the step's compiled device bytes at ``size``.
      peak_bytes: the process's runtime peak after the confirming step, an
        upper bound of that step's (``None`` where the device reports none,
        as a CPU does).
      confirmed: whether that peak was read and is within the budget:
        ``False`` where the device reports no peak, as a CPU does.
      step_ms: the median step time at ``size``.
      plan: with ``plan=True``, the plan at ``size``.
      probes: ``(size, compiled bytes)`` of every size compiled, in order.
      stopped: why the answer falls short of a size resolved and confirmed, if
        it does: the time limit, no size that fits, or no runtime peak read.
      fits_at: the largest size compiled within the budget (``None``: none
        was); ``size`` is below it where the step there ran out of memory,
        ran over the budget, or, with ``min_speed``, ran too slow.
      over_at: the smallest size above ``fits_at`` compiled over the budget
        (``None``: none was, as where the search reached ``limit``, or
        stopped at its time limit with nothing above checked). The largest
        size that fits lies in ``[fits_at, over_at)``; a search that was not
        stopped leaves them ``tolerance`` apart.
    """

    size: int
    budget_bytes: int
    compiled_bytes: int | None
    peak_bytes: int | None
    confirmed: bool
    step_ms: float | None
    plan: Plan | None
    probes: tuple[tuple[int, int], ...]
    stopped: str | None = None
    fits_at: int | None = None
    over_at: int | None = None

    def __str__(self) -> str:
        """One line: the size, its bracket, its speed, and why it falls short, if it does."""
        within = format_bytes(self.budget_bytes)
        fits = (
            f"nothing compiled within {within}"
            if self.fits_at is None
            else f"{self.fits_at} compiled within {within}"
        )
        over = "nothing above it over" if self.over_at is None else f"{self.over_at} over it"
        speed = "" if self.per_second is None else f"; {self.per_second:,.0f} per second"
        why = "" if self.stopped is None else f"; {self.stopped}"
        return f"size {self.size}: {fits}, {over}{speed}{why}"

    @property
    def per_second(self) -> float | None:
        """Sizes per second at ``size``: images per second, when the size is the batch."""
        return None if not self.step_ms else self.size / self.step_ms * 1e3


def largest_size(
    model: Any,
    step: Callable[..., Any],
    args_at: Callable[[int], Sequence[Any]],
    *,
    budget: int | float,
    plan: bool = False,
    min_speed: float | None = None,
    start: int = 8,
    limit: int = 4096,
    multiple_of: int = 1,
    smallest: int = 1,
    tolerance: float = 0.02,
    exponent: float = 1.0,
    time_limit_s: float = 600.0,
    blocks: Any = None,
    options: Any = None,
    donate_argnums: int | Sequence[int] = (),
    runs: int = 5,
    progress: bool | Callable[[str], None] = True,
) -> Fit:
    """The largest size (a batch, an image's side) whose training step fits ``budget``.

    The search compiles the step at a few sizes, resolves the largest that
    fits to within ``tolerance``, then runs one real step there to read the
    runtime peak, and times the step. If that step runs out of memory, or its
    peak is over the budget, the size steps down by ``tolerance`` and is
    checked again, at most three times.

    Args:
      model: the model, as ``step`` takes it: as given (wrapped, decorated,
        under ``nn.remat``), or, with ``plan=True``, with plannable blocks as
        :func:`jaxoffload.plan` takes it.
      step: the training step as ``step(model, *args)``, not jitted.
      args_at: the step's other arguments at a size, ``args_at(size)``. It is
        evaluated abstractly (``jax.eval_shape``), so it may build arrays
        (``jnp.zeros``, ``model.init``) without allocating them; the real
        steps run on zeros of their shapes.
      budget: device bytes (an int, or a whole number such as ``16e9``), or
        a share of the device's memory (a float in (0, 1]; where the device
        reports its limit, as a GPU does): the compiled step's arguments and
        temporaries, and the runtime peak of the confirming step.
      plan: plan the model at each size (:func:`jaxoffload.plan`), with the
        block costs measured once, at ``start``, and rescaled to each size:
        the answer is the largest size that some plan fits, at that plan's
        speed. Each size is checked first with the least plan compiled at
        ``start`` (with ``min_speed``, of those that kept it there), a uniform
        one most often, so the answer is not below the largest size at which
        that plan fits, to within ``tolerance``; where it is over, with the
        front's leanest plan (that the model puts within ``min_speed``). The plain step is compiled as
        the time reference where it may fit: not past a size where it
        compiled over the budget.
      min_speed: with ``plan=True``, the least share of the plain step's speed
        per item at ``start`` that the plan must keep (``0.7``: 70% of its
        images per second): each size is checked with plans within that
        speed, as above, and the plan found is confirmed by its measured step.
        ``None``: any speed.
      start: the first size compiled: one that fits, ideally near the answer.
        With ``plan=True``, the block costs are measured there, so it must
        run on this device.
      limit: the largest size considered.
      multiple_of: every size probed is a multiple of this (a U-Net's side
        divides by 16).
      smallest: no size below this is probed (a model's smallest input).
      tolerance: the search stops when the largest size known to fit and the
        smallest known not to are this share apart, or a ``multiple_of``.
      exponent: the search's model: bytes grow about linearly in ``size **
        exponent``, 1 for a batch, 2 for an image's side.
      time_limit_s: the search starts no compile that would not finish
        within this many seconds, as priced by the compiles before it at the
        nearest size (the first size's always runs), and answers with the
        largest size known to fit, its bracket in ``fits_at`` and
        ``over_at``; ``stopped`` says so. With ``plan=True``, planning at the
        size found compiles only the rounds that the time left holds. Only
        the confirming step, run and timed, comes after the limit.
      blocks, options, runs: as in :func:`jaxoffload.plan`, with ``plan=True``.
      donate_argnums: the arguments (after ``model``) that the training loop
        donates, as in its ``jax.jit``.
      progress: print progress to stderr, or a function that takes each line.

    Returns:
      A :class:`Fit`: the size, its compiled bytes, runtime peak and step
      time, its bracket, and every size probed.

    Raises:
      TypeError, ValueError: for an argument written wrong, before any step
        is traced; ``args_at(size)`` is evaluated first, abstractly, to check
        what it returns.
    """
    # Everything is checked before the first compile: a search compiles at every size.
    plan = checks.flag("plan", plan)
    options, runs = check_planning(
        "jaxoffload.largest_size", model, step, None, blocks=blocks, options=options, runs=runs,
        donate_argnums=donate_argnums, block_costs="traced", progress=progress, planned=plan,
    )  # fmt: skip
    start, limit, multiple_of, smallest, tolerance, exponent, time_limit_s = check_search(
        start, limit, multiple_of, smallest, tolerance, exponent, time_limit_s
    )
    min_speed = check_min_speed(min_speed, plan)
    budget = device_budget(budget)
    if not callable(args_at):
        raise TypeError(
            f"args_at must be a function of the size that returns the step's other arguments, "
            f"got {checks.written(args_at)}; write args_at=lambda n: (state, batch_of(n))."
        )
    first = -(-smallest // multiple_of) * multiple_of
    check_takes(
        args_at, (first,), "jaxoffload.largest_size", f"args_at(size), here args_at({first})",
        "args_at takes the size alone, as args_at=lambda size: (state, batch_of(size)).",
    )  # fmt: skip
    say = progress_printer(progress, "fit")
    began = time.perf_counter()
    steps = SizeSteps(model, step, args_at, budget, plan, dict(
        blocks=blocks, options=options, runs=runs, donate_argnums=donate_argnums, say=say
    ), min_speed)  # fmt: skip
    # The arguments at the smallest size, abstractly: what args_at gives is checked, and a
    # budget below them is refused, before any step compiles.
    check_takes(
        step, (model, *steps.args(first)), "jaxoffload.largest_size",
        f"step(model, *args_at(size)), here with the model and the {len(steps.args(first))} "
        f"arguments that args_at({first}) returns",
        "args_at(size) returns the step's arguments after the model, as (state, batch), and the "
        "step takes the model first, as step(model, *args).",
    )  # fmt: skip
    check_room([budget], steps.args(first), "the device's memory")
    check_donated(donate_argnums, steps.args(first))
    _check_grows(steps, first, start if start != first else first + multiple_of, limit)

    def bytes_at(size: int) -> int:
        got = steps.compiled_bytes(size)
        say(
            f"size {size}: {format_bytes(got)} "
            + ("fits" if got <= budget else "over")
            + f" {format_bytes(budget)} ({time.perf_counter() - began:.0f} s)"
        )
        return got

    def out_of_time(size: int) -> bool:
        """Whether a probe at ``size`` would not finish in the time left."""
        left, needs = time_limit_s - (time.perf_counter() - began), steps.predicted_s(size)
        if needs > left:
            say(f"size {size} would take about {needs:.0f} s to check, {max(left, 0):.0f} s left")
        return needs > left

    try:
        say(f"searching the largest size that fits {format_bytes(budget)}")
        size, stopped = largest_fitting(
            bytes_at, budget, start=start, limit=limit, multiple_of=multiple_of, smallest=smallest,
            tolerance=tolerance, exponent=exponent, out_of_time=out_of_time,
        )  # fmt: skip
        if stopped:
            say(stopped)
        for _ in range(3):
            if size < 1:
                break
            confirmed = steps.confirm(size, time_limit_s - (time.perf_counter() - began))
            if confirmed is not None:
                peak, step_ms = confirmed
                say(
                    f"size {size}: step {step_ms:.1f} ms, runtime peak "
                    + ("not reported by this device" if peak is None else format_bytes(peak))
                )
                if peak is None:
                    why = (
                        f"no runtime peak was read: this {jax.default_backend()} device reports "
                        "none, so the size is checked by its compiled bytes alone"
                    )
                    return _fit(steps, size, peak, False, step_ms, _and(stopped, why))
                if peak <= budget:
                    return _fit(steps, size, peak, True, step_ms, stopped)
                if steps.peak_before > budget:
                    why = (
                        "the process's runtime peak was over the budget before the search "
                        f"({format_bytes(steps.peak_before)}), so the step's own cannot be read"
                    )
                    return _fit(steps, size, peak, False, step_ms, _and(stopped, why))
            size = _step_down(size, multiple_of, smallest, tolerance, steps, out_of_time)
        fits_at, over_at = steps.bracket()
        # Stopped before any size fitted, the stop says so: that none fits is not known.
        why = (
            stopped
            if stopped and fits_at is None
            else _and(stopped, _none_fits(steps.probes, budget))
        )
        return Fit(
            max(size, 0), budget, None, None, False, None, None, tuple(steps.probes), why,
            fits_at, over_at,
        )  # fmt: skip
    finally:
        steps.settle()  # no compile outlives the search


def _check_grows(steps: SizeSteps, first: int, other: int, limit: int) -> None:
    """Raises if ``args_at`` gives arguments of the same shapes at ``first`` and ``other``:
    the step would compile alike at every size, and the search would answer ``limit``."""
    if other > limit:
        return

    def shapes(size):
        return [(a.shape, a.dtype) for a in jax.tree.leaves(steps.args(size))]

    if shapes(first) == shapes(other):
        raise ValueError(
            f"args_at gives arguments of the same shapes at sizes {first} and {other}, so the "
            "step would compile alike at every size and the search would answer limit: "
            "args_at(size) must build the batch at that size, such as "
            "jnp.zeros((size, 224, 224, 3)) for a batch, not close over one built beforehand."
        )


def _fit(steps: SizeSteps, size, peak, confirmed, step_ms, stopped) -> Fit:
    """The answer at ``size``, confirmed by a real step there."""
    compiled = steps.chosen.compiled_bytes if steps.plan else steps.bytes[size]
    return Fit(
        size, steps.budget, compiled, peak, confirmed, step_ms,
        steps.chosen if steps.plan else None, tuple(steps.probes), stopped, *steps.bracket(),
    )  # fmt: skip


def _and(stopped: str | None, why: str) -> str:
    """``why`` after what stopped the search, if anything did."""
    return why if stopped is None else f"{stopped}; {why}"


def _none_fits(probes, budget: int) -> str:
    """Why no size was confirmed: none compiled within the budget, or none ran within it."""
    fitting = [size for size, got in probes if got <= budget]
    if not fitting:
        size, got = min(probes, default=(None, None))
        if size is None:
            return "nothing fits: no size was compiled"
        return (
            f"nothing fits: the smallest size compiled, {size}, takes {format_bytes(got)}, over "
            f"the budget of {format_bytes(budget)}"
        )
    return (
        f"no size that compiled within the budget (the largest, {max(fitting)}) ran within it: "
        "its step ran out of memory, or no plan kept its speed"
    )


def _step_down(size, multiple_of, smallest, tolerance, steps, out_of_time) -> int:
    """The next size below ``size``, by ``tolerance``, that compiles within the budget (0: none);
    where its compile would not finish in the time left, the largest below it that did."""
    while size >= smallest:
        size -= max(multiple_of, _round_down(int(size * tolerance), multiple_of))
        if size < smallest:
            break
        if size not in steps.bytes and out_of_time(size):
            fits = [s for s, got in steps.probes if s < size and got <= steps.budget]
            return max(fits, default=0)
        if steps.compiled_bytes(size) <= steps.budget:
            return size
    return 0


def _round_down(size: int, multiple_of: int) -> int:
    return size // multiple_of * multiple_of
