"""Steps compiled and timed: the oracle that a planner's search asks.

:class:`CompiledSteps` traces, lowers and compiles a training step under plans, several at
once, and times them on the device. The planner (:class:`~jaxoffload._src.planner.search.Planner`)
measures and searches on top of it; tests stand in for it with stand-in bytes and times.
"""

from __future__ import annotations

import concurrent.futures
import math
import time
import types
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from jaxoffload._src import timing
from jaxoffload._src.planner.messages import summary
from jaxoffload._src.planner.plan import Plan
from jaxoffload._src.planner.program import device_bytes, program, trace_step
from jaxoffload._src.xla_options import compiler_options

__all__ = ["TIMED_RUNS", "CompiledSteps"]

# Runs of each whole step timed in turns: over 5, a GPU's steps spread too much to calibrate by
# (docs/design.md, "Blocks alone are not blocks in a step"); a run costs a step, against
# seconds to compile one.
TIMED_RUNS = 11


class CompiledSteps:
    """A training step's programs under plans: lowered, compiled (several at once, outside
    Python's lock) and timed on the device, each once.

    Attributes:
      compiled: every plan compiled, with its device bytes (arguments and temporaries).
      compile_s: the seconds each plan's compile took.
      executables: each compiled plan's executable.
      in_flight: plans compiling in the background (:meth:`compile_soon`), each with its
        compile, until a :meth:`compile` or :meth:`settle` has waited for it.
      lowered: plans traced and lowered, not compiled yet.
      measured_ms: each plan's step as timed alone (``inf`` where it cannot run here).
      run_limit: the device bytes over which a compiled step is not run.
    """

    # A class default too: stand-in steps skip __init__.
    in_flight: Mapping[Plan, concurrent.futures.Future] = types.MappingProxyType({})

    def __init__(self, model, step, args, plain: Plan, donate_argnums, say, run_limit=None):
        self.model, self.step, self.args, self.say = model, step, args, say
        self.donate_argnums = donate_argnums
        if run_limit is None:
            limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
            run_limit = int(0.9 * limit) if limit else None
        self.run_limit = run_limit
        self.compiled: dict[Plan, int] = {}
        self.compile_s: dict[Plan, float] = {}
        self.executables: dict[Plan, Any] = {}
        self.lowered: dict[Plan, Any] = {}
        self.measured_ms: dict[Plan, float] = {}
        self.arrays = program(model, step, args, plain)[1]  # the arguments every run takes

    def _lower(self, candidates: Sequence[Plan]) -> None:
        """Traces and lowers the candidates not compiled or lowered yet, for a later compile."""
        for c in dict.fromkeys(candidates):
            if c not in self.compiled and c not in self.lowered and c not in self.in_flight:
                self.lowered[c] = self._lowered_step(c)

    def _lowered_step(self, candidate: Plan):
        return self._traced_step(candidate).lower()

    def _traced_step(self, candidate: Plan):
        return trace_step(self.model, self.step, self.args, candidate, self.donate_argnums)

    def compile(self, candidates: Sequence[Plan]) -> None:
        """Compiles the candidates not compiled yet, several at once: those lowered already
        first, each of the others while the next is traced. Those compiling in the background
        (:meth:`compile_soon`) are waited for, not compiled twice."""
        pending = [c for c in dict.fromkeys(candidates) if c not in self.compiled]
        waiting = {self.in_flight[c] for c in pending if c in self.in_flight}
        todo = [c for c in pending if c not in self.in_flight]
        todo.sort(key=lambda c: c not in self.lowered)
        self._keep(
            self._compiled(todo, {c: self.lowered.pop(c) for c in todo if c in self.lowered})
        )
        for future in waiting:
            self._landed(future)

    def settle(self) -> None:
        """Waits for every compile in the background and keeps what it made, so that none
        outlives the search that started it; a failed one is said, not raised (nothing asked
        for it)."""
        for future in set(self.in_flight.values()):
            try:
                self._landed(future)
            except Exception as e:  # noqa: BLE001
                self.say(f"a compile in the background failed, and nothing needed it: {e!r}")

    def _landed(self, future: concurrent.futures.Future) -> None:
        """Keeps what a background compile made, and forgets it as in flight, failed or not."""
        try:
            self._keep(future.result())
        finally:
            self.in_flight = {c: f for c, f in self.in_flight.items() if f is not future}

    def compile_soon(self, candidates: Sequence[Plan], name: str | None = None) -> None:
        """Starts compiling the candidates in a thread of their own; a later :meth:`compile`
        waits for them and keeps what they compiled to. They are traced here first (a thread
        that traces holds the interpreter's lock); ``name`` says what they are when done."""
        todo = [c for c in dict.fromkeys(candidates) if c not in self.compiled]
        todo = [c for c in todo if c not in self.in_flight]
        if todo:
            self._lower(todo)
            lowered = {c: self.lowered.pop(c) for c in todo}
            pool = concurrent.futures.ThreadPoolExecutor(1)
            future = pool.submit(self._compiled, todo, lowered, name)
            pool.shutdown(wait=False)  # what it was given still runs
            self.in_flight = {**self.in_flight, **dict.fromkeys(todo, future)}

    def _compiled(self, todo: list[Plan], lowered: dict, name: str | None = None) -> list:
        """``(plan, executable, compile seconds)`` of each of ``todo``, compiled at once, those
        not in ``lowered`` traced here one after another. Shared state is left alone: a thread
        of :meth:`compile_soon` runs this while the caller reads it."""
        if not todo:
            return []
        start, tracing = time.perf_counter(), 0.0

        def each_lowered():
            nonlocal tracing
            for c in todo:
                began = time.perf_counter()
                yield lowered[c] if c in lowered else self._lowered_step(c)
                tracing += time.perf_counter() - began

        # Compiled as users compile a step that moves bytes, so that what fits here fits there.
        compiled = timing.compile_timed(each_lowered(), options=compiler_options())
        done = [(c, *got) for c, got in zip(todo, compiled)]
        longest = max(done, key=lambda d: d[2])
        self.say(
            (f"{name}: " if name else "")
            + f"compiled {len(todo)} in {time.perf_counter() - start:.1f} s, "
            f"{tracing:.1f} s of it tracing"
            + (
                f"; the longest compile {longest[2]:.1f} s, {summary(longest[0].strategies)}"
                if len(todo) > 1
                else ""
            )
        )
        return done

    def _keep(self, done: list) -> None:
        """Notes what :meth:`_compiled` compiled: each executable, its bytes and seconds."""
        for c, executable, seconds in done:
            self.executables[c], self.compiled[c] = executable, device_bytes(executable)
            self.compile_s[c] = seconds

    def step_ms(self, candidate: Plan, runs: int = 3) -> float:
        """The compiled candidate's step time, run on zeros; ``inf`` if it cannot run here."""
        if candidate not in self.measured_ms:
            self.measured_ms[candidate] = self._run(candidate, runs)
        return self.measured_ms[candidate]

    def _run(self, candidate: Plan, runs: int) -> float:
        if not self.runs_here(candidate):
            return math.inf
        return timing.step_ms(self.executables[candidate], self.arrays, runs)

    def runs_here(self, candidate: Plan) -> bool:
        return self.run_limit is None or self.compiled[candidate] <= self.run_limit

    def steps_together(self, candidates: Sequence[Plan]) -> list[tuple[float, float]]:
        """``(ms, spread)`` of each compiled candidate's step, timed in turns."""
        for c in candidates:
            self.step_ms(c)  # warmed up, and its own time noted for what it says
        executables = [self.executables[c] for c in candidates]
        return timing.steps_together(executables, self.arrays, TIMED_RUNS)
