"""Planning: a strategy per block that fits a memory budget at the least step time.

:func:`plan` takes a model (a linen one whose blocks are
:func:`jaxoffload.linen.plannable`, or an NNX one and the class of its blocks),
its training step and a budget, and returns a :class:`~jaxoffload.Plan`: one
strategy value per block, which :meth:`~jaxoffload.Plan.apply` puts on the
model. The costs come from the device (:mod:`jaxoffload._src.planner.costs`),
and every plan returned was compiled and checked against the budget.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import jax
from flax import nnx

from jaxoffload._src import nnx as offload_nnx
from jaxoffload._src import timing
from jaxoffload._src.errors import NoPlanFits
from jaxoffload._src.jaxprs import format_bytes
from jaxoffload._src.planner.apply import check_model
from jaxoffload._src.planner.budget import check_budget
from jaxoffload._src.planner.costs import (
    TIE,
    block_options,
    cost_blocks,
    estimate_peak_bytes,
    rescaled,
)
from jaxoffload._src.planner.fitted import (
    MEASURED_NOISE,
    STEADY,
    ByteLine,
    calibrated,
    fit_bytes,
    hidden_choice,
    hidden_ms_per_byte,
    kept_by_kind,
    time_errors,
    weighed,
)
from jaxoffload._src.planner.front import front
from jaxoffload._src.planner.messages import note, progress_printer, summary, where_it_stops
from jaxoffload._src.planner.plan import Plan
from jaxoffload._src.planner.program import (
    check_discovered,
    device_bytes,
    discover,
    explicit_mesh,
    lower_step,
    program,
)
from jaxoffload._src.strategies import Lean, Offload, Remat, Store, Strategy, brief, check_strategy

__all__ = ["Planner", "default_options", "plan", "progress_printer"]


def default_options() -> tuple[Strategy, ...]:
    """The strategies a block may take: every kind, and offload with windows 1 and 2.

    Host placement does nothing on a CPU (host and device memory are one),
    so there the options that offload are left out.
    """
    options: list[Strategy] = [Store(), Lean(), Remat()]
    if jax.default_backend() != "cpu":
        options += [Offload(), Offload(window=2), Offload(recompute=True)]
    return tuple(options)


def plan(
    model: Any,
    step: Callable[..., Any],
    *args: Any,
    budget: int | float | Sequence[int | float],
    blocks: Any = None,
    options: Sequence[Strategy] | None = None,
    donate_argnums: int | Sequence[int] = (),
    runs: int = 5,
    max_rounds: int = 3,
    per_round: int = 4,
    progress: bool | Callable[[str], None] = True,
) -> Plan | list[Plan | NoPlanFits]:
    """A strategy per plannable block that fits ``budget`` at the least step time.

    The costs come from the device. Each distinct block is compiled and timed
    alone under each option, its residuals are read from traces, and the host
    link is measured once; where anything moves, each block also gets hidden
    offloads (``Offload(window=w, max_bytes=cap)``, a cap of what the link
    moves while the next blocks compute). For every memory target, the
    fastest choice of one option per block is the front
    (:func:`~jaxoffload._src.planner.front.front`). The compiled step is the
    oracle: a model of its bytes, fitted to the plans compiled so far,
    proposes the fastest candidates that should fit, and they are compiled,
    several at once, until none faster is left that the model says fits.
    The plan returned is the fastest compiled one that fits, as timed where
    the steps time steadily; its ``estimated_bytes`` is what the model
    fitted to the other compiled plans predicts of it.

    Args:
      model: an unbound linen Module whose blocks are
        :func:`jaxoffload.linen.plannable`, or an NNX Module. An NNX model
        is put back as it was when planning ends.
      step: the training step as ``step(model, *args)``, not jitted: the
        planner calls it with the model under each candidate plan. An NNX
        step may update its Modules (``optimizer.update(model, grads)``).
      *args: ``step``'s other arguments, as arrays or
        :class:`jax.ShapeDtypeStruct`\\ s (a training state, a batch), or
        NNX Modules such as an ``nnx.Optimizer``.
      budget: device bytes (an int), or a share of the plain model's (a
        float in (0, 1]). Device bytes are the compiled step's arguments and
        temporaries. A sequence of budgets gives a list of plans, and
        measures the costs once. The budget is per device: with arguments
        sharded over a mesh (a batch over ``data``), the compiled bytes are
        one device's (``memory_analysis`` of a sharded program), and under
        Explicit mesh axes the blocks are sized and timed per device too.
      blocks: for an NNX model, which submodules are its blocks: a Module
        class, a tuple of them, or a function ``(path, module) -> bool``.
        A linen model's blocks are its plannable ones.
      options: the strategies a block may take; :func:`default_options` by
        default.
      donate_argnums: the arguments (after ``model``) that the training loop
        donates, as in its ``jax.jit``: the compiled checks do the same.
      runs: timed runs per block and option.
      max_rounds: rounds of compiled checks per budget.
      per_round: the candidates that one round compiles at once, each on a
        thread of its own.
      progress: print progress to stderr, or a function that takes each line.

    Returns:
      A :class:`Plan` whose compiled step fits ``budget``. For a sequence of
      budgets, a list with one entry per budget: its :class:`Plan`, or, where
      no plan fits, the :class:`NoPlanFits` that says what was reached (not
      raised, so that the plans that fit are not lost).

    Raises:
      NoPlanFits: for a single budget, if no plan's compiled step fits; the
        message gives the least that was reached.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> import jaxoffload
      >>> Dense = jaxoffload.linen.plannable(nn.Dense)
      >>> class Net(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         h = nn.relu(Dense(256)(x))
      ...         return Dense(8)(h)
      >>> def step(model, params, x):
      ...     return jax.grad(lambda p: model.apply(p, x).sum())(params)
      >>> x = jnp.ones((64, 256))
      >>> params = Net().init(jax.random.key(0), x)
      >>> p = jaxoffload.plan(Net(), step, params, x, budget=1.0, runs=1, progress=False)
      >>> [path for path, _ in p.blocks]
      ['Dense_0', 'Dense_1']
    """
    check_model(model, "jaxoffload.plan")
    say = progress_printer(progress)
    # A string is a Sequence too, but one budget written wrong, not a list of them.
    many = isinstance(budget, Sequence) and not isinstance(budget, str | bytes)
    budgets = list(budget) if many else [budget]
    for b in budgets:
        check_budget(b)
    for name, value in (("max_rounds", max_rounds), ("per_round", per_round)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    # Batch-sharded arguments over an Explicit mesh: the blocks' traced types carry their
    # sharding, so the blocks are timed and sized per device under that mesh.
    mesh = explicit_mesh(args)
    with (
        offload_nnx.classes_kept(model) if isinstance(model, nnx.Module) else nullcontext(),
        jax.set_mesh(mesh) if mesh is not None else nullcontext(),
    ):
        planner = Planner(
            model,
            step,
            args,
            options,
            blocks=blocks,
            runs=runs,
            say=say,
            donate_argnums=donate_argnums,
        )
        if not many:
            return planner.plan_for(budgets[0], max_rounds=max_rounds, per_round=per_round)
        return [_plan_or_why_not(planner, b, max_rounds, per_round) for b in budgets]


def _plan_or_why_not(planner: Planner, budget, max_rounds, per_round) -> Plan | NoPlanFits:
    """One budget of a list: its plan, or the :class:`NoPlanFits` that says what was reached."""
    try:
        return planner.plan_for(budget, max_rounds=max_rounds, per_round=per_round)
    except NoPlanFits as error:
        planner.say(str(error))
        return error


class Planner:
    """What planning measures once per model and step, and the plans it makes from it.

    The blocks are found by tracing the step and costed alone under each
    option (:mod:`~jaxoffload._src.planner.costs`); their times and bytes are
    fitted to whole compiled steps (:mod:`~jaxoffload._src.planner.fitted`),
    and their options put on the front: for every memory target, the fastest
    choice. The front proposes, the compiler says what fits, and the clock
    which of those is fastest.
    """

    def __init__(
        self,
        model,
        step,
        args,
        options,
        *,
        runs,
        say,
        blocks=None,
        donate_argnums=(),
        measured: Planner | None = None,
        run_limit: int | None = None,
    ):
        """``measured``: a Planner of the same model and step at another size, whose block
        costs are rescaled to this one's (:func:`~jaxoffload._src.planner.costs.rescaled`)
        rather than measured again. ``run_limit``: the most compiled bytes of a step that
        is run here to be timed; by default, 90% of the device's memory."""
        self.model, self.step, self.args, self.say = model, step, args, say
        self.donate_argnums = donate_argnums
        if run_limit is None:
            limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
            run_limit = int(0.9 * limit) if limit else None
        self.run_limit = run_limit
        options = (
            default_options() if options is None else tuple(check_strategy(s) for s in options)
        )
        if not options:
            raise ValueError("options is empty: a block needs at least one strategy to take.")
        self.options = options
        say("tracing the step to find the plannable blocks")
        self.paths, calls = discover(model, step, args, blocks)
        check_discovered(self.paths, calls, nnx_model=isinstance(model, nnx.Module))
        if measured is not None:
            self.link = measured.link
            self.blocks = rescaled(measured.blocks, calls)
        else:
            self.link = None
            if any(s.to_host for s in options):
                link = timing.measure_link()
                self.link = (link["d2h_gbps"], link["h2d_gbps"])
                say(f"host link: {self.link[0]:.1f} GB/s out, {self.link[1]:.1f} GB/s back")
            self.blocks = cost_blocks(self.paths, calls, options, runs=runs, say=say)
        self.compiled: dict[Plan, int] = {}  # every plan compiled, for every budget
        self.executables: dict[Plan, Any] = {}
        self.measured_ms: dict[Plan, float] = {}
        self.plain = Plan(tuple((p, Store()) for p in self.paths))
        self.arrays = program(model, step, args, self.plain)[1]
        self.hidden_ms_per_byte = 0.0 if measured is None else measured.hidden_ms_per_byte
        self.apart = frozenset() if measured is None else measured.apart
        # At another size, the kinds' byte weights that the measured planner fitted.
        self.prior = None if measured is None else measured.byte_line()
        self._put_on_front(self.prior)
        self.leanest = self._candidate(self.front[0])
        # Measured costs are checked against whole steps: every block under each option
        # (of those that move bytes, only the first: the others are link-bound variants of
        # it), and every block that has one under a hidden offload.
        kinds = [s for s in options if not s.to_host] + [s for s in options if s.to_host][:1]
        uniform = [] if measured is not None else [self.uniform(s) for s in kinds]
        choice = hidden_choice(self.choices) if uniform else None
        hidden = None if choice is None else Plan(tuple(zip(self.paths, choice)), Lean())
        checks = [*uniform, *([hidden] if hidden else [])]
        say(
            "compiling the plain step, the leanest plan on the front"
            + (f" and {len(checks)} more to fit the model to" if checks else "")
        )
        # The plain step first and alone: it autotunes the kernels that the others share.
        self._compile([self.plain])
        self._compile([self.leanest, *checks])
        # The step time that the model's estimates start from: the plain step's, or the
        # leanest plan's where the plain step is too large to run here.
        self.anchor = self.plain
        if math.isinf(self.step_ms(self.plain)):
            self.anchor = self.leanest
        plain_ms = self.step_ms(self.plain)
        say(
            f"plain step: {format_bytes(self.compiled[self.plain])}, "
            + (f"{plain_ms:.1f} ms" if math.isfinite(plain_ms) else "too large to run here")
            + f"; leanest: {format_bytes(self.compiled[self.leanest])}"
        )
        if uniform and math.isfinite(plain_ms):
            self._calibrate(uniform, hidden)

    def uniform(self, strategy: Strategy) -> Plan:
        """Every block under ``strategy``; the code outside them lean unless it stores."""
        outside = Store() if strategy.is_identity else Lean()
        return Plan(tuple((p, strategy) for p in self.paths), outside)

    def _put_on_front(self, line: ByteLine | None = None) -> None:
        """The front of the blocks' options, their kept bytes weighed by ``line`` if given."""
        self.choices = block_options(
            self.blocks, self.options, self.link, self.hidden_ms_per_byte, self.apart
        )
        if line is not None:
            self.choices = weighed(self.choices, line)
        self.front = front(self.choices)

    def _calibrate(self, uniform: Sequence[Plan], hidden: Plan | None) -> None:
        """Fits the blocks' times to the uniform steps that compute without moving
        (:func:`~jaxoffload._src.planner.fitted.time_errors`), their bytes to every plan
        compiled, and charges hidden offloads what ``hidden``'s step ran over the model."""
        plans = [
            p
            for p in dict.fromkeys(uniform)
            if not (p.strategies[0].to_host or p.strategies[0].is_identity)
            and math.isfinite(self.step_ms(p))
        ]
        if plans:
            timed = self.steps_together([self.plain, *plans])
            errors, lines, self.apart = time_errors(
                self.blocks, [p.strategies[0] for p in plans], timed
            )
            for line in lines:
                self.say(line)
            self.blocks = calibrated(self.blocks, errors)
        self._put_on_front(self.byte_line())
        if hidden is not None and math.isfinite(self.step_ms(hidden)):
            error = self.step_ms(hidden) - self.estimated_ms(hidden)
            self.say(f"hidden offloads: {self.step_ms(hidden):.1f} ms, {error:+.1f} over the model")
            noise = TIE * self.step_ms(self.plain)
            self.hidden_ms_per_byte = hidden_ms_per_byte(
                self.blocks, hidden.strategies, error - noise
            )
            self._put_on_front(self.byte_line())

    def _candidate(self, point) -> Plan:
        """The plan of a point on the front; the code outside the blocks is lean unless all store."""
        strategies = tuple(self.choices[b][k].strategy for b, k in enumerate(point.choice))
        outside = Store() if all(s.is_identity for s in strategies) else Lean()
        return Plan(tuple(zip(self.paths, strategies)), outside)

    def model_bytes(self, candidate: Plan) -> float:
        """The model of the step's peak: what the blocks hold over time, not calibrated."""
        return float(estimate_peak_bytes(self.blocks, candidate.strategies))

    def byte_line(self, without: Plan | None = None) -> ByteLine:
        """Compiled bytes as a line fitted to every compiled plan but ``without``."""
        points = [
            (kept_by_kind(self.blocks, p.strategies), got)
            for p, got in self.compiled.items()
            if p != without
        ]
        scale = float(self.compiled.get(self.plain) or max(self.compiled.values()))
        return fit_bytes(points, list(self.blocks[0].costs), scale, self.prior)

    def predict(self, candidate: Plan) -> int:
        """The compiled bytes that the line fitted to the other compiled plans predicts."""
        return self.byte_line(without=candidate)(kept_by_kind(self.blocks, candidate.strategies))

    def _compile(self, candidates: Sequence[Plan]) -> None:
        todo = [c for c in dict.fromkeys(candidates) if c not in self.compiled]
        lowered = [
            lower_step(self.model, self.step, self.args, c, self.donate_argnums) for c in todo
        ]
        for c, executable in zip(todo, timing.compile_all(lowered)):
            self.executables[c] = executable
            self.compiled[c] = device_bytes(executable)

    def step_ms(self, candidate: Plan, runs: int = 3) -> float:
        """The compiled candidate's step time, run on zeros; ``inf`` if it cannot run here."""
        if candidate not in self.measured_ms:
            self.measured_ms[candidate] = self._run(candidate, runs)
        return self.measured_ms[candidate]

    def _run(self, candidate: Plan, runs: int) -> float:
        if self.run_limit is not None and self.compiled[candidate] > self.run_limit:
            return math.inf
        return timing.step_ms(self.executables[candidate], self.arrays, runs)

    def steps_together(self, candidates: Sequence[Plan]) -> list[tuple[float, float]]:
        """``(ms, spread)`` of each compiled candidate's step, timed in turns."""
        return timing.steps_together([self.executables[c] for c in candidates], self.arrays, 5)

    def ms(self, candidate: Plan) -> float:
        """The blocks' time in the candidate's step, by the model: each option's, ties made equal."""
        total = 0.0
        for block, options, s in zip(self.blocks, self.choices, candidate.strategies):
            cost = block.cost(s)  # a strategy not among the options: as measured
            total += next(
                (o.ms for o in options if o.strategy == s), cost.forward_ms + cost.backward_ms
            )
        return total

    def estimated_ms(self, candidate: Plan) -> float:
        """The step's time by the model: the anchor's measured, with each block's change added."""
        return self.step_ms(self.anchor) + self.ms(candidate) - self.ms(self.anchor)

    def plan_for(self, budget, *, max_rounds: int = 3, per_round: int = 4) -> Plan:
        """The fastest plan, by the model, whose compiled step fits ``budget`` (bytes or a share).

        The candidates are the front's plans, fastest first. Between the
        fastest compiled one that fits and the slowest faster one that does
        not, each round compiles up to ``per_round`` together: the fastest
        that the model of compiled bytes says fits, and candidates evenly
        spaced between the two, a search that does not trust the model. A
        round finds the answer when no candidate is left between the two.
        """
        plain_bytes = self.compiled[self.plain]
        budget_bytes = int(budget * plain_bytes) if isinstance(budget, float) else int(budget)
        self.say(f"planning for {format_bytes(budget_bytes)}")
        front = {self._candidate(point) for point in self.front}
        if Store() in self.options:
            front.add(self.plain)
        # Fastest first; equal times by fewer bytes, so that the choice is the same every run.
        candidates = sorted(front, key=lambda c: (round(self.ms(c), 3), self.model_bytes(c)))

        def bounds():
            """``(over, fit)``: the slowest faster candidate known not to fit, and the fastest that does."""
            fits = [
                n
                for n, c in enumerate(candidates)
                if self.compiled.get(c, math.inf) <= budget_bytes
            ]
            fit = fits[0] if fits else len(candidates)
            over = [
                n for n, c in enumerate(candidates[:fit]) if self.compiled.get(c, -1) > budget_bytes
            ]
            return (over[-1] if over else -1), fit

        for round_ in range(1, max_rounds + 1):
            over, fit = bounds()
            between = list(range(over + 1, min(fit, len(candidates))))
            todo = [n for n in between if candidates[n] not in self.compiled]
            if not todo:
                break
            predicted = [n for n in todo if self.predict(candidates[n]) <= budget_bytes]
            probes = {predicted[0] if predicted else todo[-1]}
            probes |= {todo[k * len(todo) // per_round] for k in range(1, per_round)}
            batch = [candidates[n] for n in sorted(probes)]
            compiling = " and ".join(summary(c.strategies) for c in batch)
            self.say(f"round {round_}: compiling {compiling}")
            self._compile(batch)
        over, fit = bounds()
        if fit == len(candidates):
            least = min(self.compiled.values())
            raise NoPlanFits(
                f"no plan of {[brief(s) for s in self.options]} fits {format_bytes(budget_bytes)}: "
                f"the least compiled was {format_bytes(least)}, {least / plain_bytes:.0%} of the "
                f"plain step's {format_bytes(plain_bytes)}."
                + where_it_stops(self.link, least / plain_bytes),
                least_bytes=least,
                plain_bytes=plain_bytes,
            )
        return self._chosen(self._fastest_measured(candidates[fit], budget_bytes), budget_bytes)

    def _fastest_measured(self, best: Plan, budget_bytes: int) -> Plan:
        """Of every compiled plan that fits and runs, the fastest as timed in turns; of those
        within 1% or their spread of it, the model's fastest, so that noise cannot flip the
        choice. ``best``, the model's choice, stands where none can run here, or where their
        runs spread more than :data:`~jaxoffload._src.planner.fitted.STEADY`."""
        fits = [c for c, got in self.compiled.items() if got <= budget_bytes]
        fits = [c for c in fits if math.isfinite(self.step_ms(c))]
        if len(fits) <= 1:
            return fits[0] if fits else best
        timed = self.steps_together(fits)
        spread = max(s for _, s in timed)
        if spread > STEADY:  # too noisy to choose by: the model's choice stands
            return best
        fastest = min(ms for ms, _ in timed)
        margin = max(MEASURED_NOISE, spread)
        near = [c for c, (ms, _) in zip(fits, timed) if ms <= fastest * (1 + margin)]
        return min(near, key=lambda c: (round(self.ms(c), 3), self.model_bytes(c)))

    def _chosen(self, best: Plan, budget_bytes: int) -> Plan:
        measured = self.step_ms(best)
        # What the model says of it from every other plan compiled: a prediction, as a plan
        # compiled in the first batch had none made before.
        estimated = self.predict(best) if len(self.compiled) > 1 else self.compiled[best]
        self.say(
            f"chose {summary(best.strategies)}, outside {brief(best.outside)}: compiled "
            f"{format_bytes(self.compiled[best])} (estimated {format_bytes(estimated)}), "
            f"step {measured:.1f} ms"
        )
        return dataclasses.replace(
            best,
            budget_bytes=budget_bytes,
            estimated_bytes=estimated,
            compiled_bytes=self.compiled[best],
            estimated_step_ms=self.estimated_ms(best),
            measured_step_ms=measured,
            notes=tuple(note(b.cost(s)) for b, s in zip(self.blocks, best.strategies)),
        )
