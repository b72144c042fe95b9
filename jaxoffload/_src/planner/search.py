"""The planner's search: block costs, the front of their options, and compiled steps as the oracle.

A :class:`Planner` measures a model's blocks once (:mod:`~jaxoffload._src.planner.costs`),
calibrates them to whole compiled steps (:mod:`~jaxoffload._src.planner.calibration`), and
searches the front for each budget, compiling the candidates that the calibrated model
says fit and timing those that do. :func:`~jaxoffload._src.planner.planning.plan` is the
call that users make.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
from flax import nnx

from jaxoffload._src import timing
from jaxoffload._src.errors import NoPlanFits
from jaxoffload._src.jaxprs import format_bytes
from jaxoffload._src.planner import rounds
from jaxoffload._src.planner.arguments import BLOCK_COSTS
from jaxoffload._src.planner.budget import devices_of
from jaxoffload._src.planner.calibration import (
    calibrated,
    exposed_ms_per_byte,
    hidden_choice,
    hidden_ms_per_byte,
    time_errors,
    weighed,
)
from jaxoffload._src.planner.compiled import CompiledSteps
from jaxoffload._src.planner.costs import (
    TIE,
    cost_blocks,
    rescaled,
    step_flops,
    trace_blocks,
    traced_blocks,
    traced_options,
    waits_ms,
)
from jaxoffload._src.planner.front import front
from jaxoffload._src.planner.messages import note, summary
from jaxoffload._src.planner.peak import (
    PeakModel,
    calibrate_peak,
    estimate_peak_bytes,
    kept_bytes,
    live_bytes,
    mixed_checks,
)
from jaxoffload._src.planner.plan import Plan
from jaxoffload._src.planner.program import (
    check_discovered,
    discover,
)
from jaxoffload._src.strategies import Lean, Offload, Remat, Store, Strategy, brief, check_strategy

__all__ = ["BLOCK_COSTS", "Planner", "default_options"]


def default_options() -> tuple[Strategy, ...]:
    """The strategies a block may take: every kind, and offload with windows 1 and 2.

    Host placement does nothing on a CPU (host and device memory are one),
    so there the options that offload are left out.
    """
    options: list[Strategy] = [Store(), Lean(), Remat()]
    if jax.default_backend() != "cpu":
        options += [Offload(), Offload(window=2), Offload(recompute=True)]
    return tuple(options)


class Planner(CompiledSteps):
    """What planning measures once per model and step, and the plans it makes from it.

    The blocks are found by tracing the step and costed under each option, by their
    traced FLOPs or timed alone (:mod:`~jaxoffload._src.planner.costs`); their times and bytes are
    calibrated to whole compiled steps (:mod:`~jaxoffload._src.planner.calibration`),
    and their options put on the front: for every memory target, the fastest
    choice. The front proposes, the compiler says what fits, and the clock
    which of those is fastest.
    """

    held_bytes: int | None = None  # a class default too: stand-in planners skip __init__
    plain_may_fit = True  # a size search says where the plain step is known over the budget
    unpriced: Sequence[Plan] = ()  # the hidden offloads' check, until price_hidden has run it

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
        block_costs: str = "traced",
        held_bytes: int | None = None,
        firsts: Sequence[Plan] | None = None,
        plain_may_fit: bool = True,
    ):
        """``measured``: a Planner of the same model and step at another size, whose block
        costs are rescaled to this one's (:func:`~jaxoffload._src.planner.costs.rescaled`).
        ``run_limit``: the most compiled bytes of a step run here to be timed (90% of the
        device's memory). ``block_costs``: ``"traced"``, a block's times from its FLOPs at
        the plain step's ms per FLOP (:func:`~jaxoffload._src.planner.costs.traced_blocks`),
        or ``"timed"``, each distinct block program timed alone. ``held_bytes``: what the
        process holds on the device besides the step's arguments, which every budget counts
        beside the compiled step (``None``: none). With ``measured``: ``firsts``, the plans
        compiled first (the front's leanest and the least compiled at the measured size);
        ``plain_may_fit=False`` where the plain step is known to compile over ``run_limit``,
        so it is neither the time reference (a step too large to run is none) nor a candidate."""
        if block_costs not in BLOCK_COSTS:
            raise ValueError(f"block_costs is one of {BLOCK_COSTS}, got {block_costs!r}.")
        self.held_bytes = held_bytes
        options = (
            default_options() if options is None else tuple(check_strategy(s) for s in options)
        )
        if not options:
            raise ValueError("options is empty: a block needs at least one strategy to take.")
        self.options = options
        say("tracing the step to find the plannable blocks")
        self.paths, calls = discover(model, step, args, blocks)
        check_discovered(self.paths, calls, nnx_model=isinstance(model, nnx.Module))
        self.calls = calls
        self.plain_may_fit = plain_may_fit
        self._live: dict[tuple[Strategy, ...], list[dict[str, int]]] = {}
        self.plain = Plan(tuple((p, Store()) for p in self.paths))
        CompiledSteps.__init__(self, model, step, args, self.plain, donate_argnums, say, run_limit)
        # Measured costs are checked against whole steps: every block under each option (of
        # those that move bytes, the first: the others are link-bound variants of it), and
        # _byte_checks' plans. At another size, none: the measured planner's calibration holds.
        uniform = [] if measured is not None else self._uniform_checks()
        stored = self._byte_checks() if uniform else []
        self.checks = list(dict.fromkeys([*uniform, *stored]))
        checking = False  # whether the checks compile while the blocks are traced
        if measured is not None:
            self.link = measured.link
            self.blocks = rescaled(measured.blocks, calls)
        else:
            # The plain step first and alone: it autotunes the kernels that the other programs
            # share. XLA compiles outside Python's lock, so this thread traces the checks
            # meanwhile, and then measures the link (its copies leave the compute units to the
            # autotuning). With traced block costs nothing else needs the device: the plain step
            # is timed once it is compiled and the checks are traced (alone: a thread that
            # traces holds the lock that timed runs need), and the checks then compile while
            # the blocks are traced. Timed block costs run block programs on the device, where
            # compiles would load it: the checks compile after them.
            say("compiling the plain step, and tracing the checks and the blocks meanwhile")
            traced = self._traced_step(self.plain)
            self.lowered[self.plain] = traced.lower()
            self.compile_soon([self.plain])
            checks = [c for c in self.checks if c != self.plain]
            by_flops = block_costs == "traced"
            self._lower(checks)
            traces = None if by_flops else trace_blocks(calls, options)
            self.link = self._measure_link(options, args)
            self.compile([self.plain])
            if by_flops:
                self.step_ms(self.plain)
                say(f"compiling {len(checks)} more plans to fit the model to, meanwhile")
                self.compile_soon(checks)
                checking = True
            if traces is None:
                traces = trace_blocks(calls, options)
            per_flop = self._ms_per_flop(traced.jaxpr) if by_flops else None
            if per_flop is None:
                if checking:  # block programs are timed only once nothing compiles
                    self.compile(checks)
                self.blocks = cost_blocks(self.paths, calls, traces, runs=runs, say=say)
            else:
                say(f"costing {len(traces)} distinct block programs by their FLOPs")
                self.blocks = traced_blocks(self.paths, calls, traces, ms_per_flop=per_flop)
        if measured is not None and measured.unpriced:
            measured.price_hidden()  # what this size's hidden offloads cost, as that size's did
        self.hidden_ms_per_byte = (
            exposed_ms_per_byte(self.link) if measured is None else measured.hidden_ms_per_byte
        )
        self.untied = frozenset() if measured is None else measured.untied
        # At another size, the byte weights that the measured planner calibrated.
        self.prior = None if measured is None else measured.peak_model()
        self._put_on_front(self.prior)
        # Every block that has one under a hidden offload is checked once the uniform plans
        # are timed, or by the end of the first round where they are not (price_hidden);
        # until then, hidden copies cost their link time.
        choice = hidden_choice(self.choices, self.options) if uniform else None
        self.unpriced = [] if choice is None else [Plan(tuple(zip(self.paths, choice)), Lean())]
        # How little a step keeps: the uniform checks say; at another size, the front's
        # leanest plan and the measured size's least, as the model may misjudge which is
        # leaner away from where it was calibrated (design §10), unless the caller knows better.
        if firsts is None and measured is not None:
            least = min(measured.compiled, key=measured.compiled.__getitem__)
            firsts = [self.candidate(self.front[0]), least]
        firsts = self.checks or list(dict.fromkeys(firsts))
        # At another size, the plain step is compiled only where its bytes at the measured
        # size, scaled as its traced bytes scale, are within twice what runs here: XLA
        # rematerialises a step to fit the device's memory, but a size search probes sizes
        # far past that, where XLA takes a minute to fail; and never where it is known over.
        said = None
        if measured is not None and measured.plain in measured.compiled:
            scale = self.model_bytes(self.plain) / measured.model_bytes(measured.plain)
            said = int(measured.compiled[measured.plain] * scale)
        near = said is None or self.run_limit is None or said <= 2 * self.run_limit
        compile_plain = plain_may_fit and self.plain not in self.compiled and near
        if not checking:
            more = len([c for c in self.checks if c != self.plain])
            say(
                ("compiling the plain step and " if compile_plain else "compiling ")
                + (
                    f"{more} more plans to fit the model to"
                    if self.checks
                    else " and ".join(summary(c.strategies) for c in firsts)
                )
            )
        if compile_plain:
            self.compile([self.plain])
        if self.unpriced:  # traced while the checks compile; the calibration waits for it
            self.compile_soon(firsts)
            self.compile_soon(self.unpriced, "the hidden offloads' check")
        self.compile(firsts)
        least = min(self.compiled, key=self.compiled.__getitem__)
        # The step time that the model's estimates start from: the plain step's, or the
        # least plan's where the plain step is too large to run here.
        plain_ms = self.step_ms(self.plain) if self.plain in self.compiled else math.inf
        self.anchor = self.plain if math.isfinite(plain_ms) else least
        if self.plain not in self.compiled:
            plain = (f"about {format_bytes(said)}, " if said else "") + "not compiled"
        else:
            ran = f"{plain_ms:.1f} ms" if math.isfinite(plain_ms) else "too large to run here"
            plain = f"{format_bytes(self.compiled[self.plain])}, {ran}"
        say(
            f"plain step: {plain}; least: {format_bytes(self.compiled[least])}, "
            f"{summary(least.strategies)}"
        )
        if uniform and math.isfinite(plain_ms):
            self._calibrate(uniform)

    def _measure_link(self, options, args) -> tuple[float, float] | None:
        """The host link's ``(out, back)`` GB/s where an option moves bytes; else ``None``."""
        if not any(s.to_host for s in options):
            return None
        devices = devices_of(args)
        link = timing.measure_link(devices=devices)
        each = f" each, {len(devices)} devices at once" if len(devices) > 1 else ""
        self.say(
            f"host link: {link['d2h_gbps']:.1f} GB/s out, {link['h2d_gbps']:.1f} GB/s back{each}"
        )
        return link["d2h_gbps"], link["h2d_gbps"]

    def _ms_per_flop(self, plain_jaxpr) -> float | None:
        """The plain step's measured ms over the FLOPs of its matrix products and
        convolutions, counted as the blocks' are; ``None`` if either is unknown."""
        flops = step_flops(plain_jaxpr.jaxpr)
        ms = self.step_ms(self.plain)
        if flops <= 0 or not math.isfinite(ms):
            self.say("the plain step's FLOPs or time are unknown here: timing block programs")
            return None
        return ms / flops

    def _uniform_checks(self) -> list[Plan]:
        """The uniform plans that check the model: under each option that computes, and the
        first that moves bytes (the others are link-bound variants of it)."""
        kinds = [s for s in self.options if not s.to_host]
        kinds += [s for s in self.options if s.to_host][:1]
        return [self.uniform(s) for s in kinds]

    def _byte_checks(self) -> list[Plan]:
        """Every block stored, which tells what the outside keeps, and halves under two kinds,
        which tell each kind's bytes beside another's (``peak.mixed_checks``); the outside lean."""
        mixed = mixed_checks(len(self.paths), self.options)
        return [Plan(tuple(zip(self.paths, m)), Lean()) for m in [self.plain.strategies, *mixed]]

    def uniform(self, strategy: Strategy) -> Plan:
        """Every block under ``strategy``; the code outside them lean unless it stores."""
        outside = Store() if strategy.is_identity else Lean()
        return Plan(tuple((p, strategy) for p in self.paths), outside)

    def _put_on_front(self, model: PeakModel | None = None) -> None:
        """The front of the blocks' options, their kept bytes weighed by ``model`` if given."""
        self.blocks, self.choices = traced_options(
            self.blocks, self.calls, self.options, self.link, self.hidden_ms_per_byte, self.untied
        )
        if model is not None:
            self.choices = weighed(self.choices, self.blocks, model)
        self.front = front(self.choices)

    def _calibrate(self, uniform: Sequence[Plan]) -> None:
        """Calibrates the blocks' times to the uniform steps that compute without moving
        (:func:`~jaxoffload._src.planner.calibration.time_errors`), and their bytes to every
        plan compiled; then prices the hidden offloads, their check compiled by then."""
        # A compile autotunes its kernels on the device: steps timed beside it spread too far
        # to calibrate to (docs/design.md, "The hidden offloads' check compiles in the background").
        if any(not f.done() for f in self.in_flight.values()):
            self.say("waiting for the hidden offloads' check to compile, to time the uniform plans")
        self.compile(list(self.in_flight))  # waited for, and a failure raised: it is needed
        plans = [
            p
            for p in dict.fromkeys(uniform)
            if not (p.strategies[0].to_host or p.strategies[0].is_identity)
            and math.isfinite(self.step_ms(p))
        ]
        if plans:
            timed = self.steps_together([self.plain, *plans])
            errors, lines, self.untied = time_errors(
                self.blocks, [p.strategies[0] for p in plans], timed
            )
            for line in lines:
                self.say(line)
            self.blocks = calibrated(self.blocks, errors)
        if self.unpriced:  # against the calibrated blocks, before the first round
            self.price_hidden()
        else:
            self._put_on_front(self.peak_model())

    def price_hidden(self) -> None:
        """Charges hidden offloads what the step of :attr:`unpriced` (compiled here if it was
        not) ran over the model of copies that hide, and puts it among the checks."""
        self.compile(self.unpriced)
        for hidden in self.unpriced:
            if math.isfinite(self.step_ms(hidden)):
                self.hidden_ms_per_byte = 0.0
                self._put_on_front()
                error = self.step_ms(hidden) - self.estimated_ms(hidden)
                self.say(
                    f"hidden offloads: {self.step_ms(hidden):.1f} ms, {error:+.1f} over the model"
                )
                noise = TIE * self.step_ms(self.plain)
                self.hidden_ms_per_byte = hidden_ms_per_byte(
                    self.blocks, hidden.strategies, error - noise
                )
            else:
                self.say(
                    "hidden offloads: their check is too large to run here; their copies "
                    "stay priced at their link time"
                )
            self.checks.append(hidden)
        self.unpriced = []
        self._put_on_front(self.peak_model())

    def candidate(self, point) -> Plan:
        """The plan of a point on the front, the code outside the blocks lean."""
        strategies = tuple(self.choices[b][k].strategy for b, k in enumerate(point.choice))
        return Plan(tuple(zip(self.paths, strategies)), Lean())

    def live(self, candidate: Plan) -> list[dict[str, int]]:
        """What the candidate's blocks hold at each point of the step, by category
        (:func:`~jaxoffload._src.planner.peak.live_bytes`), worked out once."""
        if candidate.strategies not in self._live:
            self._live[candidate.strategies] = live_bytes(self.blocks, candidate.strategies)
        return self._live[candidate.strategies]

    def model_bytes(self, candidate: Plan) -> float:
        """The model of the step's peak, every traced byte as one: not calibrated."""
        return float(estimate_peak_bytes(self.blocks, candidate.strategies))

    def peak_model(self, without: Plan | None = None) -> PeakModel:
        """The model of compiled bytes calibrated to every compiled plan but ``without``."""
        points = [
            (self.live(p), p.outside.is_identity, any(s.to_host for s in p.strategies), got)
            for p, got in self.compiled.items()
            if p != without
        ]
        scale = float(self.compiled.get(self.plain) or max(self.compiled.values()))
        return calibrate_peak(points, scale, self.prior)

    def plain_bytes(self) -> int:
        """The plain step's compiled bytes, compiled first if it was not."""
        self.compile([self.plain])
        return self.compiled[self.plain]

    def predict(self, candidate: Plan) -> int:
        """The compiled bytes that the model calibrated to the other compiled plans predicts."""
        return self.peak_bytes(self.peak_model(without=candidate), candidate)

    def ms(self, candidate: Plan) -> float:
        """The blocks' time in the candidate's step, by the model: each option's, ties made
        equal; a strategy not among the options, as measured."""
        return sum(self.block_ms(b, s) for b, s in enumerate(candidate.strategies))

    def estimated_ms(self, candidate: Plan) -> float:
        """The step's time by the model: the anchor's measured, with each block's change added."""
        return self.step_ms(self.anchor) + self.ms(candidate) - self.ms(self.anchor)

    def plan_for(self, budget, *, max_rounds: int = 3, per_round: int | None = None) -> Plan:
        """The fastest plan whose compiled step fits ``budget`` beside :attr:`held_bytes`
        (:func:`~jaxoffload._src.planner.budget.plan_budget`: bytes, or a share of the plain
        step's peak as the process sees it).

        Raises :class:`NoPlanFits` if none does; :meth:`plans_for` says how it searches.
        """
        (found,) = self.plans_for([budget], max_rounds=max_rounds, per_round=per_round)
        if isinstance(found, NoPlanFits):
            raise found
        return found

    def plans_for(
        self, budgets: Sequence, *, max_rounds: int = 3, per_round: int | None = None
    ) -> list[Plan | NoPlanFits]:
        """For each budget, the fastest plan whose compiled step fits it, or why none does:
        the rounds of :func:`~jaxoffload._src.planner.rounds.plans_for`."""
        return rounds.plans_for(self, budgets, max_rounds=max_rounds, per_round=per_round)

    def block_ms(self, block: int, strategy: Strategy) -> float:
        """Block ``block``'s time under ``strategy``, as :meth:`ms` counts it: a strategy not
        among its options (a widened window) as measured, with the waits for its copies."""
        for option in self.choices[block]:
            if option.strategy == strategy:
                return option.ms
        cost = self.blocks[block].cost(strategy)
        return cost.forward_ms + cost.backward_ms + self._waits(block, strategy, strategy.window)

    def widening_gain(self, block: int, strategy: Strategy, window: int) -> float:
        """What widening block ``block``'s offload ``strategy`` to ``window`` saves: the ms of
        its copies' waits per byte held for each block longer (0 where nothing moves)."""
        moved = self.blocks[block].cost(strategy).host_bytes
        if not moved or window <= strategy.window:
            return 0.0
        saved = self._waits(block, strategy, strategy.window) - self._waits(block, strategy, window)
        return saved / (moved * (window - strategy.window))

    def _waits(self, block: int, strategy: Strategy, window: int) -> float:
        """The ms of block ``block``'s copies under ``strategy``, both ways, that the compute of
        the blocks after it within ``window`` cannot hide (0 where nothing moves)."""
        moved = self.blocks[block].cost(strategy).host_bytes
        if not moved or self.link is None:
            return 0.0
        return waits_ms(self.blocks, block, moved, self.link, window)

    def block_bytes(self, model: PeakModel, block: int, strategy: Strategy) -> int:
        """What block ``block`` keeps under ``strategy``, as ``model`` weighs it."""
        return int(kept_bytes(self.blocks[block].cost(strategy), strategy, model))

    def peak_bytes(self, model: PeakModel, candidate: Plan) -> int:
        """The candidate's compiled bytes, as ``model`` predicts them."""
        return model(self.live(candidate), candidate.outside.is_identity)

    def known_ms(self, candidate: Plan) -> float:
        """The candidate's step as timed alone, if it was; else the model's estimate."""
        return self.measured_ms.get(candidate) or self.estimated_ms(candidate)

    def chosen(self, best: Plan, budget_bytes: int) -> Plan:
        """``best`` with its figures: ``budget_bytes`` (device bytes, which its compiled step
        and :attr:`held_bytes` fit together), and what was measured and estimated of it."""
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
            held_bytes=self.held_bytes or 0,
            estimated_bytes=estimated,
            compiled_bytes=self.compiled[best],
            estimated_step_ms=self.estimated_ms(best),
            measured_step_ms=measured,
            notes=tuple(note(b.cost(s)) for b, s in zip(self.blocks, best.strategies)),
        )
