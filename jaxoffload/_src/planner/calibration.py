"""The planner's model of time calibrated to whole compiled steps, and its options weighed.

A block measured alone is not a block in a step: XLA fuses and schedules
across the whole program. So the planner times whole steps, and scales its
blocks' times to them; its model of bytes is calibrated in
:mod:`~jaxoffload._src.planner.peak`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxoffload._src.planner.costs import TIE, BlockCosts
from jaxoffload._src.planner.front import Option
from jaxoffload._src.planner.peak import PeakModel, kept_bytes
from jaxoffload._src.strategies import Store, Strategy, brief

__all__ = [
    "calibrated",
    "exposed_ms_per_byte",
    "hidden_choice",
    "hidden_ms_per_byte",
    "time_errors",
    "weighed",
]

# Two whole steps whose timed runs are this share apart, or more than their spread, differ.
MEASURED_NOISE = 0.01
# A kind whose uniform step ran this share from the plain one's, or more than their spread,
# is not tied with Store block by block: its small per-block differences are real, and tied,
# a budget with room left was spent on cuts where storing was faster (docs/design.md,
# "Blocks alone are not blocks in a step").
APART = 0.0025
# Whole steps whose runs spread more than this are too noisy to calibrate block times by: a
# GPU's steps spread well under it, a busy CPU's often far over.
STEADY = 0.02


def weighed(choices: Sequence[Sequence[Option]], blocks, model: PeakModel) -> list[list[Option]]:
    """The blocks' options with their kept bytes as ``model`` weighs them."""
    return [
        [
            dataclasses.replace(
                o, kept_bytes=int(kept_bytes(b.cost(o.strategy), o.strategy, model))
            )
            for o in options
        ]
        for b, options in zip(blocks, choices)
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
    the plain one's, beyond the noise: their blocks' small differences are real, so
    they stay untied (:func:`~jaxoffload._src.planner.costs.block_options`).
    A step whose runs spread more than :data:`STEADY` (a busy CPU's) calibrates
    nothing; the plain step's, none.
    """

    def blocks_ms(s: Strategy) -> float:
        return sum(b.cost(s).forward_ms + b.cost(s).backward_ms for b in blocks)

    (plain_ms, plain_spread), *rest = timed
    if plain_spread > STEADY:
        line = f"the plain step's runs spread {plain_spread:.0%}: too noisy to fit the blocks to"
        return {}, [line], frozenset()
    errors, lines, untied = {}, [], set()
    for strategy, (ms, spread) in zip(strategies, rest):
        model = plain_ms + blocks_ms(strategy) - blocks_ms(Store())
        said = f"{brief(strategy)} on every block: {ms:.1f} ms measured, {model:.1f} ms from the blocks alone"
        if spread > STEADY:
            lines.append(f"{said}; its runs spread {spread:.0%}, too noisy to fit to")
            continue
        if abs(ms - plain_ms) > max(spread, plain_spread, APART) * plain_ms:
            untied.add(strategy.timed_as())
        noisy = abs(ms - model) <= max(TIE, spread, plain_spread) * plain_ms
        lines.append(said + (" (within the noise: kept)" if noisy else ""))
        if not noisy:
            errors[strategy] = ms - model
    return errors, lines, frozenset(untied)


def hidden_choice(
    choices: Sequence[Sequence[Option]], given: Sequence[Strategy] = ()
) -> list[Strategy] | None:
    """Each block's hidden offload (a capped option that is not one of the ``given``
    options), or where it has none, the strategy whose compute the hidden offloads share
    (their twin on the device: ``Lean()`` for ``Offload()``'s), else its leanest option: the
    plan that checks the overlap that the hidden offloads assume, and nothing else that
    moves. ``None`` if no block has one."""
    capped = [
        [
            o.strategy
            for o in options
            if o.strategy.max_bytes is not None and o.strategy not in given
        ]
        for options in choices
    ]
    first = next((c[0] for c in capped if c), None)
    if first is None:
        return None
    twin = first.timed_as()
    picked = []
    for options, hidden in zip(choices, capped):
        if hidden:
            picked.append(hidden[0])
        elif any(o.strategy == twin for o in options):
            picked.append(twin)
        else:
            picked.append(min(options, key=lambda o: o.kept_bytes).strategy)
    return picked


def hidden_ms_per_byte(
    blocks: Sequence[BlockCosts], strategies: Sequence[Strategy], error_ms: float
) -> float:
    """What each byte that the hidden offloads of ``strategies`` move costs beyond the
    model, where their step ran ``error_ms`` over it (a measured, not a modelled, overlap)."""
    moved = sum(b.cost(s).host_bytes for b, s in zip(blocks, strategies) if s.max_bytes)
    return max(0.0, error_ms) / moved if moved else 0.0


def exposed_ms_per_byte(link: tuple[float, float] | None) -> float:
    """What a byte moved each way costs where none of its copies hides: its time on the link
    out and back, in ms (``0`` without a link).

    Example:
      >>> round(exposed_ms_per_byte((50.0, 25.0)) * 1e9)  # a billion bytes out, then back
      60
    """
    return 0.0 if link is None else sum(1e-6 / gbps for gbps in link)
