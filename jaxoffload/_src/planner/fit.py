"""The largest batch or image size whose training step fits a device budget.

Each probed size's step is compiled, allocating nothing, and its device bytes
(``memory_analysis()``: arguments and temporaries) are compared with the
budget. A CNN's step holds bytes nearly affine in the batch, and in the
pixels, so two compiles predict the answer and a few more bracket it. No size
is taken to fit because its neighbours do: compiled bytes need not be
monotone in the size, so the answer is a size that was compiled and fitted,
and one real step there confirms it by the runtime peak.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxoffload._src import checks, timing
from jaxoffload._src.errors import NoPlanFits
from jaxoffload._src.jaxprs import format_bytes
from jaxoffload._src.planner.arguments import (
    check_donated,
    check_min_speed,
    check_planning,
    check_search,
)
from jaxoffload._src.planner.budget import check_room, device_budget
from jaxoffload._src.planner.messages import progress_printer
from jaxoffload._src.planner.plan import Plan
from jaxoffload._src.planner.program import compile_step, device_bytes, program
from jaxoffload._src.planner.search import Planner

__all__ = ["Fit", "largest_fitting", "largest_size"]


@dataclasses.dataclass(frozen=True)
class Fit:
    """The largest size found, and the step there.

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
        speed. Each size is checked with the leanest plan on its front, and
        the plain step where it may fit.
      min_speed: with ``plan=True``, the least share of the plain step's speed
        per item at ``start`` that the plan must keep (``0.7``: 70% of its
        images per second): each size is checked with the leanest plan that
        the model puts within that speed, and the plan found is confirmed by
        its measured step. ``None``: any speed.
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
      time_limit_s: once this long has passed, the search compiles nothing
        more and answers with the largest size known to fit; ``stopped``
        says so. A compile already under way finishes first, and the
        confirming steps (with ``plan=True``, the plan at the size found)
        come after the limit.
      blocks, options, runs: as in :func:`jaxoffload.plan`, with ``plan=True``.
      donate_argnums: the arguments (after ``model``) that the training loop
        donates, as in its ``jax.jit``.
      progress: print progress to stderr, or a function that takes each line.

    Returns:
      A :class:`Fit`: the size, its compiled bytes, runtime peak and step
      time, and every size probed.

    Raises:
      TypeError, ValueError: for an argument written wrong, before any step
        is traced; ``args_at(size)`` is evaluated first, abstractly, to check
        what it returns.
    """
    # Everything is checked before the first compile: a search compiles at every size.
    plan = checks.flag("plan", plan)
    options, runs = check_planning(
        "jaxoffload.largest_size", model, step, None, blocks=blocks, options=options, runs=runs,
        donate_argnums=donate_argnums, block_costs="timed", progress=progress, planned=plan,
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
    say = progress_printer(progress, "fit")
    began = time.perf_counter()
    steps = _Steps(model, step, args_at, budget, plan, dict(
        blocks=blocks, options=options, runs=runs, donate_argnums=donate_argnums, say=say
    ), min_speed)  # fmt: skip
    # The arguments at the smallest size, abstractly: what args_at gives is checked, and a
    # budget below them is refused, before any step compiles.
    first = -(-smallest // multiple_of) * multiple_of
    check_room([budget], steps.args(first), "the device's memory")
    check_donated(donate_argnums, steps.args(first))

    def bytes_at(size: int) -> int:
        got = steps.compiled_bytes(size)
        say(
            f"size {size}: {format_bytes(got)} "
            + ("fits" if got <= budget else "over")
            + f" {format_bytes(budget)} ({time.perf_counter() - began:.0f} s)"
        )
        return got

    def out_of_time() -> bool:
        return time.perf_counter() - began > time_limit_s

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
        confirmed = steps.confirm(size)
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
                return steps.fit(size, peak, False, step_ms, _and(stopped, why))
            if peak <= budget:
                return steps.fit(size, peak, True, step_ms, stopped)
            if steps.peak_before > budget:
                why = (
                    "the process's runtime peak was over the budget before the search "
                    f"({format_bytes(steps.peak_before)}), so the step's own cannot be read"
                )
                return steps.fit(size, peak, False, step_ms, _and(stopped, why))
        size = _step_down(size, multiple_of, smallest, tolerance, steps, budget)
    return Fit(
        max(size, 0), budget, None, None, False, None, None, tuple(steps.probes),
        _and(stopped, _none_fits(steps.probes, budget)),
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


def _step_down(size, multiple_of, smallest, tolerance, steps, budget) -> int:
    """The next size below ``size``, by ``tolerance``, that compiles within the budget (0: none)."""
    while size >= smallest:
        size -= max(multiple_of, _round_down(int(size * tolerance), multiple_of))
        if size >= smallest and steps.compiled_bytes(size) <= budget:
            return size
    return 0


def _round_down(size: int, multiple_of: int) -> int:
    return size // multiple_of * multiple_of


class _Steps:
    """The step at each size: its compiled bytes, and one real run to confirm it."""

    def __init__(self, model, step, args_at, budget, plan, planning, min_speed=None):
        self.model, self.step, self.args_at, self.budget = model, step, args_at, budget
        self.plan, self.planning, self.min_speed = plan, planning, min_speed
        self.planners: dict[int, Planner] = {}
        self.executables: dict[int, Any] = {}
        self.structs: dict[int, tuple] = {}
        self.bytes: dict[int, int] = {}
        self.probes: list[tuple[int, int]] = []
        self.chosen: Plan | None = None
        self.peak_before = _peak_bytes() or 0

    def args(self, size: int) -> tuple:
        """``args_at(size)``, abstractly: traced once per size (a model's init, say). The
        structs that it gives keep their shardings, which ``eval_shape`` drops where they
        are not in the types (Auto mesh axes)."""
        if size not in self.structs:
            given = []

            def args_at():
                args = self.args_at(size)
                if not isinstance(args, tuple | list):
                    raise TypeError(
                        f"args_at({size}) must return the step's arguments after the model, as "
                        f"a tuple such as (state, batch), got {checks.written(args)}; write "
                        "return (state, batch), or return (batch,) for one."
                    )
                args = tuple(args)
                given.extend(jax.tree.leaves(args))
                return args

            structs, tree = jax.tree.flatten(jax.eval_shape(args_at))
            structs = [
                g if isinstance(g, jax.ShapeDtypeStruct) and g.sharding is not None else s
                for s, g in zip(structs, given)
            ]
            self.structs[size] = tuple(jax.tree.unflatten(tree, structs))
        return self.structs[size]

    def compiled_bytes(self, size: int) -> int:
        if size not in self.bytes:
            if self.plan and self.min_speed is not None:
                planner = self._planner(size)
                got = planner.compiled[planner.leanest_within(self._slowest_ms(size))]
            elif self.plan:  # the least compiled: the leanest plan, the plain step if it may fit
                got = min(self._planner(size).compiled.values())
            else:
                executable = compile_step(
                    self.model, self.step, self.args(size), None, self.planning["donate_argnums"]
                )
                self.executables[size] = executable
                got = device_bytes(executable)
            self.bytes[size] = got
            self.probes.append((size, got))
        return self.bytes[size]

    def _slowest_ms(self, size: int) -> float:
        """The slowest step at ``size`` that keeps ``min_speed`` of the plain step's speed
        per item at the first size planned."""
        first, planner = next(iter(self.planners.items()))
        return size * planner.step_ms(planner.plain) / first / self.min_speed

    def _planner(self, size: int) -> Planner:
        if size not in self.planners:
            measured = next(iter(self.planners.values()), None)
            self.planners[size] = Planner(
                self.model, self.step, self.args(size), self.planning["options"],
                runs=self.planning["runs"], say=self.planning["say"],
                blocks=self.planning["blocks"], donate_argnums=self.planning["donate_argnums"],
                measured=measured, run_limit=self.budget,
            )  # fmt: skip
        return self.planners[size]

    def confirm(self, size: int) -> tuple[int | None, float] | None:
        """``(peak, step ms)`` of real steps at ``size``; ``None`` if no plan fits, none keeps
        ``min_speed``, or memory ran out."""
        if self.plan:
            try:
                self.chosen = self._planner(size).plan_for(self.budget)
            except NoPlanFits:
                return None
            step_ms = self.chosen.measured_step_ms
            if step_ms is None or math.isinf(step_ms):
                return None
            slowest = math.inf if self.min_speed is None else self._slowest_ms(size)
            if step_ms > slowest:
                self.planning["say"](
                    f"size {size}: the plan's step, {step_ms:.1f} ms, is slower than "
                    f"{self.min_speed:g} of the plain step's speed ({slowest:.1f} ms)"
                )
                return None
            return _peak_bytes(), step_ms
        _, arrays, _ = program(
            self.model, self.step, self.args(size), None, self.planning["donate_argnums"]
        )
        step_ms = timing.step_ms(self.executables[size], arrays, self.planning["runs"])
        return None if math.isinf(step_ms) else (_peak_bytes(), step_ms)

    def fit(self, size, peak, confirmed, step_ms, stopped) -> Fit:
        compiled = self.chosen.compiled_bytes if self.plan else self.bytes[size]
        return Fit(
            size, self.budget, compiled, peak, confirmed, step_ms,
            self.chosen if self.plan else None, tuple(self.probes), stopped,
        )  # fmt: skip


def _peak_bytes() -> int | None:
    """The largest device's runtime peak: a sharded step's budget is per device."""
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
    return max((p for p in peaks if p is not None), default=None)


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
    out_of_time: Callable[[], bool] = lambda: False,
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

    Returns:
      ``(size, stopped)``: ``stopped`` says why the search ended early, if
      ``out_of_time()`` did, else ``None``.

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
    while True:
        check(probe)
        good = max((u for u in seen if seen[u] <= budget), default=low - 1)
        bad = min((u for u in seen if seen[u] > budget and u > good), default=top + 1)
        widths.append(bad - good)
        if bad - good <= max(1, int(good * tolerance)):
            return (good * multiple_of if good >= low else 0), None
        if out_of_time():
            above = "nothing above it was checked" if bad > top else f"{bad * multiple_of} does not"
            fits = f"{good * multiple_of} fits" if good >= low else "no size fitted yet"
            return max(0, good * multiple_of) if good >= low else 0, (
                f"stopped at the time limit: {fits}, {above}"
            )
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
