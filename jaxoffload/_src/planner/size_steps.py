"""A size search's training step at each size: compiled, priced in time, and confirmed.

Without a plan, each size compiles the step as given. With one, each size has a
:class:`~jaxoffload._src.planner.search.Planner`, its block costs measured at the
first size and rescaled, and is checked with a seed, the least plan compiled at
the first size (that kept ``min_speed`` there), then, where that is over the
budget, with the front's leanest plan: so a uniform plan's largest size is, to
the search's tolerance, a floor for the plan's. What each probe took prices the
next, so that a search stops before a compile that its time limit would not hold.
"""

from __future__ import annotations

import math
import time
from typing import Any

import jax

from jaxoffload._src import checks, timing
from jaxoffload._src.errors import NoPlanFits
from jaxoffload._src.planner.plan import Plan
from jaxoffload._src.planner.program import compile_step, device_bytes, program
from jaxoffload._src.planner.search import Planner

__all__ = ["SizeSteps", "leanest_within", "peak_bytes"]

# A planned probe past the first size compiles its seed, and the front's leanest plan where
# the seed is over the budget: before any such probe is timed, it is priced at this many
# of the longest compile at the first size.
PROBE_COMPILES = 2
# Planning's rounds at the size found (Planner.plan_for's), each up to this many compiles:
# as many as the time left holds.
ROUNDS, ROUND_COMPILES = 3, 4


class SizeSteps:
    """The step at each size: its compiled bytes, and one real run to confirm it."""

    def __init__(self, model, step, args_at, budget, plan, planning, min_speed=None):
        self.model, self.step, self.args_at, self.budget = model, step, args_at, budget
        self.plan, self.planning, self.min_speed = plan, planning, min_speed
        self.planners: dict[int, Planner] = {}
        self.executables: dict[int, Any] = {}
        self.structs: dict[int, tuple] = {}
        self.bytes: dict[int, int] = {}
        self.probes: list[tuple[int, int]] = []
        self.seconds: dict[int, float] = {}  # what each size's probe took
        self.seed: Plan | None = None
        self.chosen: Plan | None = None
        self.peak_before = peak_bytes() or 0

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
            began = time.perf_counter()
            if self.plan:
                got = self._planned_bytes(size)
            else:
                executable = compile_step(
                    self.model, self.step, self.args(size), None, self.planning["donate_argnums"]
                )
                self.executables[size] = executable
                got = device_bytes(executable)
            self.seconds[size] = time.perf_counter() - began
            self.bytes[size] = got
            self.probes.append((size, got))
        return self.bytes[size]

    def bracket(self) -> tuple[int | None, int | None]:
        """The largest size compiled within the budget, and the smallest above it compiled over."""
        fits = max((s for s, got in self.probes if got <= self.budget), default=None)
        over = (s for s, got in self.probes if got > self.budget and (fits is None or s > fits))
        return fits, min(over, default=None)

    def predicted_s(self, size: int) -> float:
        """What a probe at ``size`` would take: what the one at the nearest size probed took,
        the first planned aside (it measured the blocks too); before another, with
        ``plan=True``, :data:`PROBE_COMPILES` of the longest compile at the first size."""
        first = next(iter(self.planners), None)
        timed = {s: took for s, took in self.seconds.items() if s != first}
        if timed:
            return timed[min(timed, key=lambda s: (abs(s - size), -s))]
        if first is None:
            return 0.0
        return PROBE_COMPILES * max(self.planners[first].compile_s.values(), default=0.0)

    def _planned_bytes(self, size: int) -> int:
        """The least compiled bytes at ``size`` of a plan that may keep ``min_speed``: the seed's,
        and where it is over the budget, the front's leanest that the model puts within it."""
        planner = self.planner_at(size)
        seed = self._seed()
        planner.compile([seed])
        got = planner.compiled[seed]
        if got > self.budget:  # whether a leaner plan fits is the question left
            plain_ms = self._plain_ms(size) if self.min_speed is not None else math.inf
            added = math.inf if math.isinf(plain_ms) else plain_ms * (1 / self.min_speed - 1)
            leanest = leanest_within(planner, added)
            if leanest is not None:
                planner.compile([leanest])
                got = min(got, planner.compiled[leanest])
        return got

    def settle(self) -> None:
        """Waits for the compiles that each size's planner left in the background."""
        for planner in self.planners.values():
            planner.settle()

    def _seed(self) -> Plan:
        """The plan that each size checks first: the least compiled at the first size, of those
        whose step there kept ``min_speed`` (any, without one). A uniform plan most often, so
        the size found is not below the largest at which that plan fits (design §10). The
        plain step only where no other kept the speed: past its largest size it is known over."""
        if self.seed is None:
            first, planner = next(iter(self.planners.items()))
            slowest = math.inf if self.min_speed is None else self.slowest_ms(first)
            kept = [c for c in planner.compiled if planner.measured_ms.get(c, math.inf) <= slowest]
            kept = [c for c in kept if c != planner.plain] or kept or list(planner.compiled)
            self.seed = min(kept, key=planner.compiled.__getitem__)
        return self.seed

    def _plain_over(self, size: int) -> bool:
        """Whether the plain step compiled over the budget at ``size`` or below: it cannot fit
        here, and a step too large to run is no time reference."""
        return any(
            s <= size and p.compiled.get(p.plain, 0) > self.budget for s, p in self.planners.items()
        )

    def _plain_ms(self, size: int) -> float:
        """The plain step's time at ``size``, at its speed per item at the first size planned."""
        first, planner = next(iter(self.planners.items()))
        return size * planner.step_ms(planner.plain) / first

    def slowest_ms(self, size: int) -> float:
        """The slowest step at ``size`` that keeps ``min_speed`` of the plain step's speed
        per item at the first size planned."""
        return self._plain_ms(size) / self.min_speed

    def planner_at(self, size: int) -> Planner:
        if size not in self.planners:
            measured = next(iter(self.planners.values()), None)
            self.planners[size] = Planner(
                self.model, self.step, self.args(size), self.planning["options"],
                runs=self.planning["runs"], say=self.planning["say"],
                blocks=self.planning["blocks"], donate_argnums=self.planning["donate_argnums"],
                measured=measured, run_limit=self.budget,
                firsts=None if measured is None else [self._seed()],
                plain_may_fit=measured is None or not self._plain_over(size),
            )  # fmt: skip
        return self.planners[size]

    def confirm(self, size: int, left_s: float = math.inf) -> tuple[int | None, float] | None:
        """``(peak, step ms)`` of real steps at ``size``; ``None`` if no plan fits, none keeps
        ``min_speed``, or memory ran out. With ``plan=True``, planning there compiles as many
        rounds as ``left_s`` seconds hold, priced by the longest compile at that size."""
        self.settle()  # a compile beside the step would load the runtime peak it reads
        if self.plan:
            planner = self.planner_at(size)
            longest = max(planner.compile_s.values(), default=0.0)
            rounds = ROUNDS
            if longest and math.isfinite(left_s):
                rounds = min(ROUNDS, max(0, int(left_s // (ROUND_COMPILES * longest))))
            if rounds < ROUNDS:
                self.planning["say"](f"size {size}: time left for {rounds} planning rounds")
            try:
                self.chosen = planner.plan_for(self.budget, max_rounds=rounds)
            except NoPlanFits:
                return None
            step_ms = self.chosen.measured_step_ms
            if step_ms is None or math.isinf(step_ms):
                return None
            slowest = math.inf if self.min_speed is None else self.slowest_ms(size)
            if step_ms > slowest:
                self.planning["say"](
                    f"size {size}: the plan's step, {step_ms:.1f} ms, is slower than "
                    f"{self.min_speed:g} of the plain step's speed ({slowest:.1f} ms)"
                )
                return None
            return peak_bytes(), step_ms
        _, arrays, _ = program(
            self.model, self.step, self.args(size), None, self.planning["donate_argnums"]
        )
        step_ms = timing.step_ms(self.executables[size], arrays, self.planning["runs"])
        return None if math.isinf(step_ms) else (peak_bytes(), step_ms)


def peak_bytes() -> int | None:
    """The largest device's runtime peak: a sharded step's budget is per device."""
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
    return max((p for p in peaks if p is not None), default=None)


def leanest_within(planner: Planner, added_ms: float) -> Plan | None:
    """The front's leanest plan whose blocks the model puts within ``added_ms`` of the plain
    step's blocks (``None``: none is).

    Differences of the model's block times, not its whole-step estimate: that is anchored
    at a measured step, which at a size whose least plan is over the budget cannot run.
    """
    base = planner.ms(planner.plain)
    within = (c for c in map(planner.candidate, planner.front) if planner.ms(c) - base <= added_ms)
    return next(within, None)
