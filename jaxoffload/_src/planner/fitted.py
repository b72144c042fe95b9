"""The planner's models fitted to whole compiled steps: bytes by a line, times by a scale.

A block measured alone is not a block in a step. XLA fuses some traced
residuals away and adds buffers of its own, and fuses and schedules across
the whole program; so the planner compiles and times whole steps, and fits
its models of bytes and time to them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxoffload._src.planner.costs import TIE, BlockCosts
from jaxoffload._src.planner.front import Option
from jaxoffload._src.strategies import Store, Strategy, brief

__all__ = [
    "ByteLine",
    "calibrated",
    "fit_bytes",
    "hidden_choice",
    "hidden_ms_per_byte",
    "kept_by_kind",
    "time_errors",
    "weighed",
]

# How strongly the byte weights are pulled (see fit_bytes), against the compiled plans'
# squared errors in units of the plain step's bytes.
SHARED_WEIGHT_PULL = 1e-4
KIND_WEIGHT_PULL = 1e-2

# Two whole steps whose timed runs are this share apart, or more than their spread, differ.
MEASURED_NOISE = 0.01
# A kind whose uniform step ran this share from the plain one's, or more than their spread,
# is not tied with Store block by block: on ResNet-50 b256 on an H200, Lean's ran 0.5 to 3.5%
# slower, and tied, the plan for 0.75 of the plain step's bytes was all Lean at 72% of it.
APART = 0.0025
# Whole steps whose runs spread more than this are too noisy to fit block times to: a
# GPU's steps of tens of ms spread well under it, a busy CPU's by 3 to 60%.
STEADY = 0.02


@dataclasses.dataclass(frozen=True)
class ByteLine:
    """Compiled bytes as ``rest + sum(weights[kind] * kept[kind])``, and ``stored_outside``
    more where the code outside the blocks stores its residuals rather than cutting them.

    The outside is a model's stem and head: ResNet-50's stem alone keeps
    tensors of 112x112x64 per image. ``scale`` is the plain step's bytes, that
    a line fitted at one size rescales ``stored_outside`` by at another.
    """

    rest: float
    weights: dict[Strategy, float]
    stored_outside: float = 0.0
    scale: float = 1.0

    def __call__(self, kept: dict[Strategy, int], outside_stores: bool = False) -> int:
        kept_part = sum(self.weights.get(k, 1.0) * b for k, b in kept.items())
        return int(self.rest + kept_part + self.stored_outside * outside_stores)


def kept_by_kind(
    blocks: Sequence[BlockCosts], strategies: Sequence[Strategy]
) -> dict[Strategy, int]:
    """Per kind of strategy (as costed), the bytes its blocks keep between the passes."""
    sums: dict[Strategy, int] = {}
    for block, s in zip(blocks, strategies):
        cost = block.cost(s)
        sums[s.costed()] = sums.get(s.costed(), 0) + cost.device_bytes + cost.input_bytes
    return sums


def fit_bytes(
    points: Sequence[tuple[dict[Strategy, int], bool, int]],
    kinds: Sequence[Strategy],
    scale: float,
    prior: ByteLine | None = None,
) -> ByteLine:
    """The line through ``(kept by kind, outside stores, compiled bytes)`` points, by least squares.

    Traced residuals are not XLA's buffers: ResNet-50's uniform plans compiled
    to between a third and a half of their traced residuals on an H200, over
    2.5 GiB of the rest of the step. The fit has one weight shared by every
    kind, pulled towards 1 (the traced bytes) only as far as one point needs
    for an answer, and each kind's difference from it, pulled towards 0, so
    that a kind no point tells apart takes the shared weight; what the outside
    keeps when it stores is pulled towards 0 too. ``scale`` (the plain step's
    bytes, say) sets the units in which the pulls count. A few points cannot
    tell the rest from the weights: with a ``prior`` (a line fitted at another
    size), the line takes the prior's weights, and fits only its rest.
    """
    if prior is not None:
        stored_outside = prior.stored_outside * scale / prior.scale
        without_rest = ByteLine(0.0, prior.weights, stored_outside, scale)
        rest = np.mean([got - without_rest(kept, stores) for kept, stores, got in points])
        return dataclasses.replace(without_rest, rest=float(rest))
    rows, ys = [], []
    for kept, stores, got in points:
        row = [kept.get(k, 0) / scale for k in kinds]
        rows.append([1.0, float(stores), sum(row), *row])
        ys.append(got / scale)
    pulls = [(KIND_WEIGHT_PULL, 0.0), (SHARED_WEIGHT_PULL, 1.0)]
    pulls += [(KIND_WEIGHT_PULL, 0.0)] * len(kinds)
    for column, (pull, target) in enumerate(pulls, start=1):
        rows.append([np.sqrt(pull) * (j == column) for j in range(len(kinds) + 3)])
        ys.append(np.sqrt(pull) * target)
    solution = np.linalg.lstsq(np.array(rows), np.array(ys), rcond=None)[0]
    rest, stored_outside, shared = solution[:3]
    weights = {k: max(0.0, float(shared + d)) for k, d in zip(kinds, solution[3:])}
    return ByteLine(float(rest) * scale, weights, max(0.0, float(stored_outside)) * scale, scale)


def weighed(choices: Sequence[Sequence[Option]], line: ByteLine) -> list[list[Option]]:
    """The blocks' options with their kept bytes as ``line`` weighs their kind's."""
    return [
        [
            dataclasses.replace(
                o, kept_bytes=int(o.kept_bytes * line.weights.get(o.strategy.costed(), 1.0))
            )
            for o in options
        ]
        for options in choices
    ]


def calibrated(blocks: Sequence[BlockCosts], errors: dict[Strategy, float]) -> list[BlockCosts]:
    """The blocks with each strategy's backward passes scaled to what whole steps measured.

    ``errors[s]`` is how far a step with every block under ``s`` ran from the
    blocks' sum, in ms; each block's backward pass under ``s`` takes its
    share of that, by its time, so that the model of the step meets the
    measured step at every uniform plan. A strategy not measured so takes the
    error of one that was and computes alike (a lean cut, or recomputation),
    in proportion; moving bytes is priced by the link, not here.
    """
    factors = {}
    for strategy, error in errors.items():
        backward = sum(b.costs[strategy].backward_ms for b in blocks)
        factors[strategy] = max(0.0, 1 + error / backward) if backward > 0 else 1.0

    def factor(s: Strategy) -> float:
        alike = [f for m, f in factors.items() if (m.cuts, m.recomputes) == (s.cuts, s.recomputes)]
        return factors.get(s, alike[0] if alike else 1.0)

    return [
        dataclasses.replace(
            b,
            costs={
                s: dataclasses.replace(c, backward_ms=c.backward_ms * factor(s))
                for s, c in b.costs.items()
            },
        )
        for b in blocks
    ]


def time_errors(
    blocks: Sequence[BlockCosts],
    strategies: Sequence[Strategy],
    timed: Sequence[tuple[float, float]],
) -> tuple[dict[Strategy, float], list[str], frozenset[Strategy]]:
    """How far each uniform step ran from its blocks' sum, beyond the noise, and what to say.

    ``timed`` is ``(ms, spread)`` of the plain step, then of each step with
    every block under one of ``strategies``, timed in turns. An error within
    the spread of the runs (or :data:`~jaxoffload._src.planner.costs.TIE`)
    is noise, and left out. Also returns the kinds whose steps ran apart from
    the plain one's, beyond the noise: their blocks' small differences are real.
    A step whose runs spread more than :data:`STEADY` (a busy CPU's) fits
    nothing; the plain step's, none.
    """

    def blocks_ms(s: Strategy) -> float:
        return sum(b.cost(s).forward_ms + b.cost(s).backward_ms for b in blocks)

    (plain_ms, plain_spread), *rest = timed
    if plain_spread > STEADY:
        line = f"the plain step's runs spread {plain_spread:.0%}: too noisy to fit the blocks to"
        return {}, [line], frozenset()
    errors, lines, apart = {}, [], set()
    for strategy, (ms, spread) in zip(strategies, rest):
        model = plain_ms + blocks_ms(strategy) - blocks_ms(Store())
        said = f"{brief(strategy)} on every block: {ms:.1f} ms measured, {model:.1f} ms from the blocks alone"
        if spread > STEADY:
            lines.append(f"{said}; its runs spread {spread:.0%}, too noisy to fit to")
            continue
        if abs(ms - plain_ms) > max(spread, plain_spread, APART) * plain_ms:
            apart.add(strategy.timed_as())
        noisy = abs(ms - model) <= max(TIE, spread, plain_spread) * plain_ms
        lines.append(said + (" (within the noise: kept)" if noisy else ""))
        if not noisy:
            errors[strategy] = ms - model
    return errors, lines, frozenset(apart)


def hidden_choice(choices: Sequence[Sequence[Option]]) -> list[Strategy] | None:
    """Each block's first hidden offload (a capped one), or its leanest option where it has
    none: the plan that checks the overlap the hidden offloads assume. ``None`` if no block
    has one."""
    picked = []
    for options in choices:
        capped = [o.strategy for o in options if o.strategy.max_bytes is not None]
        picked.append(capped[0] if capped else min(options, key=lambda o: o.kept_bytes).strategy)
    return picked if any(s.max_bytes is not None for s in picked) else None


def hidden_ms_per_byte(
    blocks: Sequence[BlockCosts], strategies: Sequence[Strategy], error_ms: float
) -> float:
    """What each byte that the hidden offloads of ``strategies`` move costs beyond the
    model, where their step ran ``error_ms`` over it (a measured, not a modelled, overlap)."""
    moved = sum(b.cost(s).host_bytes for b, s in zip(blocks, strategies) if s.max_bytes)
    return max(0.0, error_ms) / moved if moved else 0.0
