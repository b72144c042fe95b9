"""A budget's rounds: compiled candidates between what fits and what does not, then timed.

:func:`plans_for` searches a :class:`~jaxoffload._src.planner.search.Planner`'s candidates
for every budget together: the model of compiled bytes proposes, the compiler says what
fits, and the clock which of those is fastest.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from jaxoffload._src.errors import NoPlanFits
from jaxoffload._src.jaxprs import format_bytes
from jaxoffload._src.planner.budget import measured_against, plan_budget
from jaxoffload._src.planner.calibration import MEASURED_NOISE, STEADY
from jaxoffload._src.planner.messages import summary, where_it_stops
from jaxoffload._src.planner.peak import PeakModel
from jaxoffload._src.planner.plan import Plan
from jaxoffload._src.strategies import Store, Strategy, brief

__all__ = ["per_budget", "plans_for", "widened_plans"]

# Where a round looks for a budget: the first candidates that the model of compiled bytes
# says fit the budget, and 5% less or more, as the model is off by a few percent.
PROBE_SHARES = (1.0, 0.95, 1.05)
# The plans that fit which are timed against each other: the model's fastest few.
TIMED_FASTEST = 4
# Of those, only the ones that a run or the model puts within this share of the fastest:
# a plan 5% slower does not win a turn-taking won by 1%, and each timed plan costs seconds.
TIMED_WITHIN = 0.05
# A candidate that the model puts over a budget by more than it has overstated any plan it
# proposed (of those that move bytes, or of those that do not), and this share more, cannot
# fit it; the first round, with nothing proposed yet, rules out none. The share is for errors
# larger than any seen yet: a wider one spent rounds on candidates that the model had put
# just over the budget, and that compiled there (docs/design.md §14).
OVERSTATED_MARGIN = 0.01
# The candidates a round compiles by default, in all, and at least for each budget: a
# round's compiles run at once, but its candidates are traced one after another.
ROUND_CANDIDATES = 4
LEAST_PER_BUDGET = 2
# The windows that a chosen plan's uncapped offloads are widened to (widened_plans): a
# window this wide let a ResNet-50 plan's copies hide under more compute at the same peak,
# where a wider one compiled over its budget (design §13, "Window 4, timed").
WIDER = (4,)


def per_budget(budgets: int) -> int:
    """The candidates that a round compiles for each of ``budgets`` by default.

    One budget takes four, so that a round brackets it from both sides; several take two
    each, so that the candidates traced one after another do not outgrow the compiles
    (``docs/design.md``, "Planning for a budget", has the planning times behind this).

    Example:
      >>> [per_budget(n) for n in (1, 2, 3)]
      [4, 2, 2]
    """
    return max(LEAST_PER_BUDGET, ROUND_CANDIDATES // budgets)


def plans_for(
    planner, budgets: Sequence, *, max_rounds: int = 3, per_round: int | None = None
) -> list[Plan | NoPlanFits]:
    """For each budget, the fastest plan whose compiled step fits it, or why none does.

    The candidates are the front's plans and the uniform ones compiled to check
    the model, fastest by the model first. For each budget, between the fastest
    compiled one that fits and the slowest faster one that does not, a round
    compiles up to ``per_round`` (by default :func:`per_budget`): those that the
    model of compiled bytes says fit the budget, or nearly, and candidates evenly
    spaced between the two, a search that does not trust the model. Where the front
    has no candidate left between them, the round walks from the one that fits
    towards a faster one instead, block by block (:func:`_between`): the compiled step, not the
    model, then says where on that path the budget falls. After the first
    round, a candidate that the model puts over the budget by more than it has
    overstated any plan that it proposed and that compiled (and
    :data:`OVERSTATED_MARGIN` more) is not compiled for it. A budget is done
    when no candidate is left between them that the model says is faster by
    more than the timing noise. The budgets' rounds compile together, and the
    plan returned is the fastest of the compiled ones that fit, as timed. The
    hidden offloads' check (``planner.unpriced``) is compiled by the end of the first
    round; the price its step measures may put faster candidates on the front.

    Each budget is device bytes that the compiled step fits beside what the process
    holds besides its arguments, ``planner.held_bytes``; a share is of the plain
    step's peak as the process sees it (:func:`~jaxoffload._src.planner.budget.plan_budget`).
    """
    per_round = per_round or per_budget(len(budgets))
    held = planner.held_bytes
    # The plain step compiles only for a share: at sizes far past the device's memory, a
    # size search plans for bytes without it.
    plain = planner.plain_bytes() if any(isinstance(b, float) for b in budgets) else None
    devices = [plan_budget(b, plain, held) for b in budgets]
    for b, device in zip(budgets, devices):
        planner.say("budget " + measured_against(b, device, plain, held))
    # What each compiled step must fit: its budget, less what the process holds beside it.
    targets = [device - (held or 0) for device in devices]
    # The front's plans, and the plans compiled already (the checks, a size search's seed):
    # compiled bytes need not follow the front, and a uniform plan may compile smaller than
    # the front's leanest. The plain step where blocks may store, unless it is known over.
    front = {planner.candidate(point) for point in planner.front} | set(planner.checks)
    front |= {c for c in planner.compiled if c != planner.plain}
    if Store() in planner.options and planner.plain_may_fit:
        front.add(planner.plain)
    model = planner.peak_model()

    def by_model(c):  # fastest first; equal times by fewer bytes, the same choice every run
        return round(planner.ms(c), 3), planner.peak_bytes(model, c)

    def with_hidden_priced(candidates):  # their check compiled, its price on the front
        checked = list(planner.unpriced)
        planner.price_hidden()
        front = {planner.candidate(point) for point in planner.front}
        return sorted(set(candidates) | front | set(checked), key=by_model)

    candidates = sorted(front, key=by_model)
    said: dict[Plan, int] = {}  # what the model said of each plan it proposed, before it compiled
    # The round that compiles the hidden offloads' check does not count: the price it measures
    # gets a round to act on. Where no round runs, the check compiles alone, after them.
    for round_ in range(1, max_rounds + 1 + bool(max_rounds and planner.unpriced)):
        trust = _Trust(model, _overstated(planner, said))
        probes = [
            _probes(planner, candidates, t, trust, per_round)
            or _between(planner, candidates, t, trust, per_round)
            for t in targets
        ]
        batch = list(dict.fromkeys(c for chosen in probes for c in chosen))
        # The first round ends with the hidden offloads' check compiled (it began beside the
        # checks); once it has run, their price may put faster candidates on the front.
        unpriced = list(planner.unpriced)
        if not batch and not unpriced:
            break
        candidates = sorted(set(candidates) | set(batch), key=by_model)
        doing = ["compiling " + " and ".join(summary(c.strategies) for c in batch)] if batch else []
        if unpriced:
            compiling = any(c in planner.in_flight for c in unpriced)
            doing.append(("finishing" if compiling else "timing") + " the hidden offloads' check")
        planner.say(f"round {round_}: " + ", and ".join(doing))
        said.update({c: planner.peak_bytes(model, c) for c in batch})
        planner.compile([*batch, *unpriced])
        if unpriced:
            candidates = with_hidden_priced(candidates)
        model = planner.peak_model()  # through the plans just compiled too
    if planner.unpriced:  # no round ran
        candidates = with_hidden_priced(candidates)
    best = {t: _best_fit(planner, candidates, t) for t in targets}
    # Widening compiles once more: not where the caller left no time for rounds, nor for a
    # plan that cannot run here to be timed against.
    widened = {
        t: widened_plans(b, planner.widening_gain) if max_rounds and planner.runs_here(b) else []
        for t, b in best.items()
        if isinstance(b, Plan)
    }
    batch = list(dict.fromkeys(w for ws in widened.values() for w in ws))
    batch = [w for w in batch if w not in planner.compiled]
    if batch:
        names = " and ".join(summary(c.strategies) for c in batch)
        planner.say(f"widening the offloads' windows: compiling {names}")
        planner.compile(batch)
    to_time = {
        t: _to_time(planner, b, t, widened[t]) for t, b in best.items() if isinstance(b, Plan)
    }
    # Every budget's plans timed in one turn-taking, so that each is timed once.
    union = list(dict.fromkeys(c for plans in to_time.values() for c in plans))
    timed = dict(zip(union, planner.steps_together(union))) if len(union) > 1 else {}
    if timed:
        planner.say(
            f"timed {len(timed)} compiled plans that fit in turns: "
            + ", ".join(f"{ms:.1f} ms ±{spread:.1%}" for ms, spread in timed.values())
        )
    if len(planner.compiled) > 1:
        planner.say(
            "compiled against predicted from the others: "
            + ", ".join(
                f"{summary(c.strategies)} {format_bytes(got)} {planner.predict(c) / got - 1:+.0%}"
                for c, got in sorted(planner.compiled.items(), key=lambda item: -item[1])
            )
        )
    return [
        best[t]
        if isinstance(best[t], NoPlanFits)
        else planner.chosen(_fastest(planner, best[t], to_time[t], timed), device)
        for t, device in zip(targets, devices)
    ]


@dataclasses.dataclass(frozen=True)
class _Trust:
    """A round's model of compiled bytes, and how far to trust it: the most that it has
    overstated a plan that it proposed, by whether the plan moves bytes."""

    model: PeakModel
    overstated: dict[bool, float]

    def rules_out(self, planner, candidate: Plan, budget_bytes: int) -> bool:
        """Whether ``candidate`` is over ``budget_bytes`` by more than the model can be wrong."""
        bound = self.overstated.get(_moves(candidate))
        if bound is None:
            return False
        limit = budget_bytes * (1 + bound) * (1 + OVERSTATED_MARGIN)
        return planner.peak_bytes(self.model, candidate) > limit


def _overstated(planner, said: dict[Plan, int]) -> dict[bool, float]:
    """By whether a plan moves bytes, the most that what the model ``said`` of a plan it
    proposed was over what that plan compiled to (0 where it said less of each)."""
    bounds: dict[bool, float] = {}
    for c, predicted in said.items():
        error = max(0.0, predicted / planner.compiled[c] - 1)
        bounds[_moves(c)] = max(bounds.get(_moves(c), 0.0), error)
    return bounds


def _moves(candidate: Plan) -> bool:
    return any(s.to_host for s in candidate.strategies)


def _fits(planner, candidates: Sequence[Plan], budget_bytes: int) -> tuple[int, int]:
    """``(over, fit)``: the slowest faster candidate known not to fit, and the fastest that does."""
    fits = [
        n for n, c in enumerate(candidates) if planner.compiled.get(c, math.inf) <= budget_bytes
    ]
    fit = fits[0] if fits else len(candidates)
    over = [n for n, c in enumerate(candidates[:fit]) if planner.compiled.get(c, -1) > budget_bytes]
    return (over[-1] if over else -1), fit


def _probes(planner, candidates, budget_bytes: int, trust: _Trust, per_round: int) -> list[Plan]:
    """The candidates that a round compiles for one budget; none when it is done."""
    model = trust.model
    over, fit = _fits(planner, candidates, budget_bytes)
    faster_than = (
        planner.ms(candidates[fit]) * (1 - MEASURED_NOISE) if fit < len(candidates) else math.inf
    )
    todo = [
        n
        for n in range(over + 1, min(fit, len(candidates)))
        if candidates[n] not in planner.compiled
        and planner.ms(candidates[n]) < faster_than
        and not trust.rules_out(planner, candidates[n], budget_bytes)
    ]
    if not todo:
        return []
    picks = []
    for share in PROBE_SHARES:  # the model's answer, and either side of it
        fitting = [
            n for n in todo if planner.peak_bytes(model, candidates[n]) <= share * budget_bytes
        ]
        picks += fitting[:1]
    picks = list(dict.fromkeys(picks or [todo[-1]]))
    spaced = (todo[k * len(todo) // per_round] for k in range(1, per_round))
    picks += [n for n in spaced if n not in picks][: max(0, per_round - len(picks))]
    return [candidates[n] for n in sorted(picks[:per_round])]


def _between(planner, candidates, budget_bytes: int, trust: _Trust, per_round: int) -> list[Plan]:
    """Plans on the way from the fastest compiled one that fits to a faster one, for a
    round to compile where the front has none left between them: to the slowest
    faster one that does not fit, or, once the two are a block apart, to the fastest
    candidate (:func:`_walk`)."""
    over, fit = _fits(planner, candidates, budget_bytes)
    if fit >= len(candidates):
        return []
    towards = ([candidates[over]] if over >= 0 else []) + [candidates[0]]
    for fast in towards:
        plans = _walk(planner, candidates[fit], fast, budget_bytes, trust, per_round)
        if plans:
            return plans
    return []


def _walk(planner, slow: Plan, fast: Plan, budget_bytes: int, trust: _Trust, per_round: int):
    """Uncompiled plans from ``slow`` (compiled, and fits) towards ``fast``.

    The blocks where the two differ switch one at a time from ``slow``'s strategy
    to ``fast``'s, most time saved per byte added first, as in a knapsack. The
    plans are the greedy knapsack's answer (each switch in turn that the model,
    anchored at ``slow``'s compiled bytes, says still fits) and the path's plans
    evenly spaced, which do not trust the model beyond what it has overstated.
    """
    model = trust.model
    if planner.ms(fast) >= planner.ms(slow) * (1 - MEASURED_NOISE):
        return []
    gains = []
    for b, (was, to) in enumerate(zip(slow.strategies, fast.strategies)):
        saved = planner.block_ms(b, was) - planner.block_ms(b, to) if was != to else 0.0
        if saved > 0:
            added = planner.block_bytes(model, b, to) - planner.block_bytes(model, b, was)
            gains.append((-saved / max(added, 1), b))

    def switched(blocks):
        strategies = list(slow.strategies)
        for b in blocks:
            strategies[b] = fast.strategies[b]
        return Plan(tuple(zip(planner.paths, strategies)), slow.outside)

    order = [b for _, b in sorted(gains)]
    if not order:
        return []
    path = [switched(order[:k]) for k in range(1, len(order) + 1)]
    # What the model says each plan adds to slow's compiled bytes: the peak is not a sum
    # of the blocks' bytes, so each switch is weighed in the plan it joins.
    room = budget_bytes - planner.compiled[slow] + planner.peak_bytes(model, slow)
    greedy = []
    for b in order:
        if planner.peak_bytes(model, switched([*greedy, b])) <= room:
            greedy.append(b)
    spaced = [path[k * len(path) // (per_round + 1)] for k in range(1, per_round + 1)]
    spaced = [c for c in spaced if not trust.rules_out(planner, c, budget_bytes)]
    plans = [switched(greedy)] if greedy else []
    plans += [c for c in spaced if c not in plans]
    return [c for c in plans if c not in planner.compiled][:per_round]


def _best_fit(planner, candidates, budget_bytes: int) -> Plan | NoPlanFits:
    """The model's fastest compiled candidate that fits, or why none does."""
    _, fit = _fits(planner, candidates, budget_bytes)
    if fit < len(candidates):
        return candidates[fit]
    plain_bytes = planner.plain_bytes()
    least = min(planner.compiled.values())
    held = planner.held_bytes
    besides = f" (its budget less {format_bytes(held)} held besides the step)" if held else ""
    error = NoPlanFits(
        f"no plan of {[brief(s) for s in planner.options]} fits {format_bytes(budget_bytes)}"
        f"{besides}: "
        f"the least compiled was {format_bytes(least)}, {least / plain_bytes:.0%} of the "
        f"plain step's {format_bytes(plain_bytes)}."
        + where_it_stops(any(s.to_host for s in planner.options)),
        least_bytes=least,
        plain_bytes=plain_bytes,
    )
    planner.say(str(error))
    return error


def widened_plans(
    plan: Plan, gain: Callable[[int, Strategy, int], float] | None = None
) -> list[Plan]:
    """``plan`` with the windows of its uncapped offloads widened to each of :data:`WIDER`:
    all of them, and the half that ``gain(block, strategy, window)`` ranks first.

    The search prices a window by the copies the next blocks' compute hides and by the bytes
    it holds meanwhile, and its model of the second is least sure of wide windows (design §13).
    So the windows are widened only once the blocks' kinds are chosen: each plan compiled,
    those that fit are timed against ``plan``, and the clock decides. A wider window holds a
    block's moved bytes longer, so where widening all of them does not fit, the half that saves
    the most wait for each byte held a block longer (``Planner.widening_gain``) may.

    Example:
      >>> from jaxoffload import Offload, Plan, Remat
      >>> plan = Plan((("a", Offload()), ("b", Remat()), ("c", Offload(window=2))))
      >>> [[s.window for s in p.strategies] for p in widened_plans(plan, lambda b, s, w: b)]
      [[4, 1, 4], [1, 1, 4]]
    """
    paths = [path for path, _ in plan.blocks]
    out = []
    for window in WIDER:
        narrow = [
            b
            for b, s in enumerate(plan.strategies)
            if s.to_host and s.max_bytes is None and s.window < window
        ]
        chosen = [narrow]
        if gain is not None and len(narrow) > 1:
            ranked = sorted(narrow, key=lambda b: -gain(b, plan.strategies[b], window))
            chosen.append(ranked[: len(narrow) // 2])
        for blocks in chosen:
            if blocks:
                strategies = [
                    dataclasses.replace(s, window=window, fetch_window=None) if b in blocks else s
                    for b, s in enumerate(plan.strategies)
                ]
                out.append(Plan(tuple(zip(paths, strategies)), plan.outside))
    return list(dict.fromkeys(out))


def _to_time(planner, best: Plan, budget_bytes: int, widened: Sequence[Plan] = ()) -> list[Plan]:
    """The plans that fit to time against ``best``, the model's choice: ``best`` with wider
    windows (:func:`widened_plans`), the model's few fastest, and the uniform plans (the
    points a user compares with), that can run here, each within :data:`TIMED_WITHIN` of the
    fastest of them, as timed alone if it was
    (:meth:`~jaxoffload._src.planner.search.Planner.known_ms`) or by the model; the widened
    ones whatever the model says of them."""
    if not planner.runs_here(best):
        return []
    wider = [
        c
        for c in widened
        if planner.compiled.get(c, math.inf) <= budget_bytes and planner.runs_here(c)
    ]
    by_model = lambda c: (round(planner.ms(c), 3), planner.compiled[c])  # noqa: E731
    fits = sorted(
        (
            c
            for c, got in planner.compiled.items()
            if got <= budget_bytes and c != best and planner.runs_here(c)
        ),
        key=by_model,
    )
    fits = [best, *(c for c in fits if c not in wider)]
    fits = fits[:TIMED_FASTEST] + [c for c in fits[TIMED_FASTEST:] if c in planner.checks]
    fastest = min(planner.known_ms(c) for c in fits)
    return [
        c for c in fits if c == best or planner.known_ms(c) <= (1 + TIMED_WITHIN) * fastest
    ] + wider


def _fastest(planner, best: Plan, plans: Sequence[Plan], timed) -> Plan:
    """``best``, unless one of ``plans`` ran faster than it, as ``timed`` in turns, by more
    than 1% and both their spreads: then the fastest such. A plan whose runs spread more
    than :data:`~jaxoffload._src.planner.calibration.STEADY` is not compared, and ``best``
    stands where it is not timed steadily."""
    if best not in timed or timed[best][1] > STEADY:
        return best
    best_ms, best_spread = timed[best]
    faster = [
        c
        for c in plans
        if timed[c][1] <= STEADY
        and timed[c][0] * (1 + max(MEASURED_NOISE, timed[c][1], best_spread)) < best_ms
    ]
    return min(faster, key=lambda c: timed[c][0]) if faster else best
