"""The step's peak over time, and what compiled steps say each kind of byte costs in it.

A compiled step's device bytes are its peak: the most it holds at one point.
Where that point is depends on the plan. With most blocks storing, it is the
turn from the forward to the backward pass, where every block's residuals are
alive; with the early blocks recomputing, it is in their backward pass, where
one block's recomputed residuals meet the inputs kept before it. A sum of what
the blocks keep says the first and not the second: on ResNet-50 and
MobileNetV2 on an H200 it overstated plans that recompute their early blocks
far (docs/design.md, "Memory is a peak over time"). So :func:`live_bytes`
walks the two passes and says, at each point, what is alive by category, and
:class:`PeakModel` weighs the categories by what compiled steps measured
(:func:`calibrate_peak`): traced residuals are not XLA's buffers, which fuses some
away and adds its own. The activations between blocks and the running block's input
and output are whole arrays, which a compiled step holds as traced: their weight is 1,
not calibrated, since every uniform plan holds nearly the same of them and a fit could
not tell them from the rest of the step.
A weight is told only by plans that hold its category at their peak; uniform
plans each hold their own kind alone, so :func:`mixed_checks` gives the plans
that tell each kind's weight beside another's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from jaxoffload._src.planner.costs import BlockCost, BlockCosts
from jaxoffload._src.strategies import Store, Strategy, brief

__all__ = [
    "PeakModel",
    "category",
    "compiled_points",
    "estimate_peak_bytes",
    "calibrate_peak",
    "kept_bytes",
    "live_bytes",
    "mixed_checks",
]

# The categories of bytes that are not a block's residuals.
KEPT_EDGES = "kept edges"  # activations between blocks, kept for the backward pass
EDGES = "edges"  # the running block's input and output, in the forward pass
IN_FLIGHT = "in flight"  # device copies of residuals on their way to or from the host
RECOMPUTED = "recomputed"  # what a backward pass recomputes and holds at once
# What a block's backward pass holds besides its residuals, counted by its input and output:
# their cotangents, and what its cut recomputes, which fusion shrinks or grows.
BACKWARD = "backward work"

# A category's weight where no compiled step says it: traced residuals are not XLA's
# buffers, and a compiled step holds a fraction of them (docs/design.md, "Memory is a peak
# over time"). Whole arrays are held as traced, at 1: copies in flight too, though the
# scheduler decides how long each is held, so theirs is calibrated from there.
PRIOR_WEIGHT = 0.5
PRIORS = {KEPT_EDGES: 1.0, EDGES: 1.0, IN_FLIGHT: 1.0}
# The whole arrays whose weight is their prior, not calibrated (see the module's docstring).
WHOLE = (KEPT_EDGES, EDGES)
# How strongly the weights are pulled to their priors, and the bytes of a stored outside to
# 0, against the compiled plans' squared errors in units of the plain step's bytes: only as
# far as the plans need for an answer, so that a weight no plan tells apart keeps the prior.
WEIGHT_PULL = 1e-2
# Rounds of the calibration (each plan's peak point found, then the weights solved for at those
# points); it stops earlier when the points no longer move.
CALIBRATION_ROUNDS = 20


def category(strategy: Strategy) -> str:
    """What a block's device residuals under ``strategy`` count as: its kind as costed, and,
    with a byte cap, the residuals that the cap leaves on the device."""
    name = brief(strategy.costed())
    return name if strategy.max_bytes is None else f"{name}, capped"


def mixed_checks(n: int, options: Sequence[Strategy]) -> list[tuple[Strategy, ...]]:
    """Plans of ``n`` blocks that tell the calibration each kind's weight beside another kind's.

    A uniform plan holds one kind alone: its own category, the kept edges and
    the rest. Estimated from the other uniform plans, its kind's weight rests on
    a prior and the rest takes what the prior gets wrong: a lean kind's estimate
    fell far below its compiled bytes and a recomputing kind's far above, and
    what XLA keeps of a lean cut differs by family, so no prior suits them all
    (``docs/design.md``, "Checks that tell each weight"). So each kind that
    computes on the device, but ``Store``, takes the first half of the blocks,
    the largest in a CNN, and the next such kind the rest (``Store`` where there
    is one kind alone): its residuals, or its recomputation, meet another kind's
    at one peak.
    """
    kinds = [s for s in dict.fromkeys(options) if not (s.to_host or s.is_identity)]
    partners = kinds[1:] + kinds[:1] if len(kinds) > 1 else [Store()] * (Store() in options)
    half = max(1, n // 2)
    plans = [(first,) * half + (then,) * (n - half) for first, then in zip(kinds, partners)]
    return [p for p in dict.fromkeys(plans) if len(set(p)) > 1]


def live_bytes(blocks: Sequence[BlockCosts], choice: Sequence[Strategy]) -> list[dict[str, int]]:
    """At each point of the step, the bytes that the blocks hold there, by category.

    The forward pass runs the blocks in order, each adding what it keeps; the
    backward pass runs them in reverse, each holding what it keeps, what it
    fetched, what it recomputes and the activations at its edges, while the
    blocks before it hold theirs. An activation between two blocks counts
    once, if either keeps it. With an ``Offload`` window ``w``, a block's
    device copies live until ``w - 1`` blocks later, and its fetched
    residuals from the backward pass of the block ``w - 1`` later. What the
    rest of the step holds (parameters, gradients, the stem) is not here.
    """
    costs = [b.cost(s) for b, s in zip(blocks, choice)]
    kinds = [category(s) for s in choice]
    windows = [s.window for s in choice]
    host = [c.host_bytes for c in costs]

    def in_flight(i):  # host bytes of earlier blocks whose transfers overlap block i
        first = max(0, i - max(windows) + 1)
        return sum(host[j] for j in range(first, i) if j + windows[j] > i)

    def kept(k: int, c: BlockCost) -> dict[str, int]:
        boundary = c.input_bytes > 0 or (k > 0 and costs[k - 1].output_bytes > 0)
        return {kinds[k]: c.device_bytes, KEPT_EDGES: blocks[k].input_bytes if boundary else 0}

    def plus(*parts: Mapping[str, int], minus: Mapping[str, int] | None = None) -> dict[str, int]:
        total: dict[str, int] = {}
        for part in parts:
            for name, n in part.items():
                total[name] = total.get(name, 0) + n
        for name, n in (minus or {}).items():
            total[name] -= n
        return total

    points, live = [], {}
    for i, c in enumerate(costs):
        edges = blocks[i].input_bytes + blocks[i].output_bytes
        running = {EDGES: edges, kinds[i]: c.device_bytes, IN_FLIGHT: host[i] + in_flight(i)}
        points.append(plus(live, running))
        live = plus(live, kept(i, c))
    live = plus(live, {KEPT_EDGES: costs[-1].output_bytes} if costs else {})
    for i in reversed(range(len(costs))):
        c, edges = costs[i], blocks[i].input_bytes + blocks[i].output_bytes
        live = plus(live, minus=kept(i, c))
        work = {IN_FLIGHT: host[i] + in_flight(i), RECOMPUTED: c.recompute_bytes, BACKWARD: edges}
        points.append(plus(live, kept(i, c), work))
    return points


def estimate_peak_bytes(blocks: Sequence[BlockCosts], choice: Sequence[Strategy]) -> int:
    """The most device bytes that the blocks' residuals and work hold at once, over the step,
    every byte as traced (:func:`live_bytes`, unweighed)."""
    return max((sum(p.values()) for p in live_bytes(blocks, choice)), default=0)


def kept_bytes(cost: BlockCost, strategy: Strategy, model: PeakModel) -> float:
    """What a block keeps between the passes under ``strategy``, as ``model`` weighs it."""
    kept = cost.device_bytes * model.weight(category(strategy))
    return kept + cost.input_bytes * model.weight(KEPT_EDGES)


@dataclasses.dataclass(frozen=True)
class PeakModel:
    """Compiled bytes as ``rest`` plus the most that the weighed categories sum to at one
    point of the step, and ``stored_outside`` more where the code outside the blocks stores
    its residuals rather than cutting them.

    The outside is a model's stem and head: ResNet-50's stem alone keeps
    tensors of 112x112x64 per image. ``scale`` is the plain step's bytes, that
    a model calibrated at one size rescales ``stored_outside`` by at another.
    """

    rest: float
    weights: dict[str, float]
    stored_outside: float = 0.0
    scale: float = 1.0

    def __call__(self, live: Sequence[Mapping[str, int]], outside_stores: bool = False) -> int:
        peak = max((self.weighed(point) for point in live), default=0.0)
        return int(self.rest + peak + self.stored_outside * outside_stores)

    def weight(self, name: str) -> float:
        """A category's weight: as calibrated, 1 for whole arrays, or its prior."""
        return self.weights.get(name, _prior(name))

    def weighed(self, point: Mapping[str, int], leave_out: Sequence[str] = ()) -> float:
        """The bytes alive at one point, each category by its weight (but ``leave_out``)."""
        return sum(self.weight(k) * n for k, n in point.items() if k not in leave_out)


def calibrate_peak(
    points: Sequence[tuple[Sequence[Mapping[str, int]], bool, bool, int]],
    scale: float,
    prior: PeakModel | None = None,
) -> PeakModel:
    """The model through ``(live bytes, outside stores, moves, compiled bytes)`` points.

    Least squares with each plan's peak at the point that the weights put it:
    found, solved for, found again, until it stays; the rest, the stored outside
    and every weight bounded at 0. First through the plans
    that move nothing, then, with what those fixed, the weights of what only
    moving plans hold (what stays on the device under ``Offload``, what is in
    flight, what recomputing blocks keep): XLA's host offloads compile less like
    their trace than the rest,
    and would pull the weights that every other plan shares. ``scale`` (the
    plain step's bytes, say) sets the units in which the pulls count. With a
    ``prior`` (a model calibrated at another size), the model takes its weights
    and calibrates only its rest.
    """
    if not points:
        raise ValueError("calibrate_peak needs at least one compiled plan.")
    if prior is not None:
        stored_outside = prior.stored_outside * scale / prior.scale
        without_rest = PeakModel(0.0, prior.weights, stored_outside, scale)
        rest = np.mean([got - without_rest(live, stores) for live, stores, _, got in points])
        return dataclasses.replace(without_rest, rest=float(rest))
    staying = [p for p in points if not p[2]] or list(points)

    def seen(plans) -> set[str]:
        return {name for live, *_ in plans for point in live for name, n in point.items() if n}

    model = PeakModel(0.0, {name: _prior(name) for name in WHOLE}, 0.0, scale)
    model = _least_squares(
        staying, scale, sorted(seen(staying) - set(WHOLE)), model, with_rest=True
    )
    only_moving = seen(points) - seen(staying) - set(WHOLE)
    if only_moving:
        model = _least_squares(points, scale, sorted(only_moving), model, with_rest=False)
    return model


def _least_squares(points, scale: float, free: Sequence[str], start: PeakModel, *, with_rest: bool):
    """``start`` with the weights of ``free`` (and, ``with_rest``, its rest and stored
    outside) calibrated to ``points`` by rounds of least squares at each plan's peak point;
    of the rounds' models, the one with the least squared error."""

    def error(model: PeakModel) -> float:
        return sum((model(live, stores) - got) ** 2 for live, stores, _, got in points)

    first = 2 if with_rest else 0  # the columns of the rest and of a stored outside
    pulls = [(1, 0.0)] if with_rest else []
    pulls += [(first + j, _prior(name)) for j, name in enumerate(free)]
    model, best = start, start
    for _ in range(CALIBRATION_ROUNDS):
        rows, ys = [], []
        for live, stores, _, got in points:
            at = max(live, key=model.weighed)
            held = model.weighed(at, leave_out=free)
            if not with_rest:
                held += model.rest + model.stored_outside * stores
            rows.append([1.0, float(stores)] * with_rest + [at.get(k, 0) / scale for k in free])
            ys.append((got - held) / scale)
        for column, target in pulls:
            rows.append([np.sqrt(WEIGHT_PULL) * (j == column) for j in range(first + len(free))])
            ys.append(np.sqrt(WEIGHT_PULL) * target)
        # Solved within the bounds, not clamped after: a clamp leaves the other columns
        # solved for the value it threw away, and the model then misses the very plans it
        # was calibrated to (the plain step, where the outside's bytes came out below zero).
        # scipy comes with jax; imported when a model is calibrated, as importing jaxoffload
        # loads nothing that flax does not (tests/test_package.py).
        from scipy.optimize import nnls

        solution = nnls(np.array(rows), np.array(ys))[0]
        weights = dict(model.weights)
        weights.update({k: float(w) for k, w in zip(free, solution[first:])})
        rest, stored = model.rest, model.stored_outside
        if with_rest:
            rest, stored = float(solution[0]) * scale, float(solution[1]) * scale
        solved = PeakModel(rest, weights, stored, scale)
        if solved == model:
            break
        model = solved
        if error(model) < error(best):
            best = model
    return best


def _prior(name: str) -> float:
    """A category's weight before any compiled step tells it."""
    return PRIORS.get(name, PRIOR_WEIGHT)


def compiled_points(planner) -> dict:
    """Every plan that ``planner`` compiled so far, with what its model said of it: to
    calibrate other models of compiled bytes by, offline, and to see where planning's time went.

    ``blocks``: per block, its path, its input and output bytes (``edges``), and under each
    option and each strategy it takes in a compiled plan, its bytes as traced (``device``,
    ``input``, ``output``, ``host``, ``recompute``: the fields of
    :class:`~jaxoffload._src.planner.costs.BlockCost`), from which :func:`live_bytes` can be
    worked out again; ``plans``: per compiled plan, its blocks' strategies and the code
    outside them (as :func:`~jaxoffload._src.strategies.brief` writes them), its compiled
    bytes, the model's prediction from the other plans, the uncalibrated peak model, its
    compile in seconds, its step in ms where it was timed, and whether it is one of the planner's
    ``checks`` (compiled whatever the model says: the model's own points, and the hidden
    offloads' check once it is priced) rather than a plan that the search proposed.
    """
    checks = set(planner.checks)
    blocks = []
    for i, b in enumerate(planner.blocks):
        taken = [c.strategies[i] for c in planner.compiled]
        costs = {s: b.cost(s) for s in dict.fromkeys([*b.costs, *taken])}
        blocks.append(
            {
                "path": b.path,
                "edges": [b.input_bytes, b.output_bytes],
                "costs": {
                    brief(s): {
                        "device": c.device_bytes,
                        "input": c.input_bytes,
                        "output": c.output_bytes,
                        "host": c.host_bytes,
                        "recompute": c.recompute_bytes,
                    }
                    for s, c in costs.items()
                },
            }
        )
    plans = [
        {
            "strategies": [brief(s) for s in c.strategies],
            "outside": brief(c.outside),
            "compiled_bytes": got,
            "predicted_bytes": planner.predict(c) if len(planner.compiled) > 1 else None,
            "model_bytes": planner.model_bytes(c),
            "compile_s": planner.compile_s.get(c),
            "step_ms": planner.measured_ms.get(c),
            "check": c in checks,
        }
        for c, got in planner.compiled.items()
    ]
    return {"paths": list(planner.paths), "blocks": blocks, "plans": plans}
