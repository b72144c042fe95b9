"""The front of plans: the knapsack over blocks' options, against exhaustive search."""

import itertools
import random

import pytest

from jaxoffload._src.planner.front import Option, front


def _exhaustive(blocks, target):
    """The fastest choice whose kept bytes fit ``target``, by trying every one."""
    best = None
    for choice in itertools.product(*(range(len(options)) for options in blocks)):
        kept = sum(blocks[b][k].kept_bytes for b, k in enumerate(choice))
        ms = sum(blocks[b][k].ms for b, k in enumerate(choice))
        if kept <= target and (best is None or ms < best[0]):
            best = (ms, kept)
    return best


def _random_blocks(seed, n, options):
    rng = random.Random(seed)
    return [
        [Option(k, rng.randint(0, 10**9), rng.uniform(1.0, 3.0)) for k in range(options)]
        for _ in range(n)
    ]


@pytest.mark.parametrize("seed", range(12))
def test_the_front_is_the_exhaustive_optimum_within_rounding(seed):
    blocks = _random_blocks(seed, n=4, options=4)
    points = front(blocks, resolution=512)
    most = sum(max(o.kept_bytes for o in options) for options in blocks)
    for target in [most * f for f in (0.1, 0.25, 0.4, 0.55, 0.7, 0.85, 1.0)]:
        exact = _exhaustive(blocks, target)
        fitting = [p for p in points if p.kept_bytes <= target]
        if exact is None:
            assert not fitting
            continue
        assert fitting, target
        got = min(p.ms for p in fitting)
        # Bytes are counted in steps of most / 512, rounded up: a choice the front takes
        # fits, and it is as fast as the best one that fits with a step per block to spare.
        assert exact[0] <= got + 1e-9
        spare = _exhaustive(blocks, target - len(blocks) * most / 512)
        if spare is not None:
            assert got <= spare[0] + 1e-9, (target, exact, got, spare)


def test_the_front_runs_from_the_leanest_to_the_fastest():
    blocks = _random_blocks(0, n=16, options=6)
    points = front(blocks)
    assert all(a.ms > b.ms and a.kept_bytes < b.kept_bytes for a, b in zip(points, points[1:]))
    assert points[-1].ms == pytest.approx(sum(min(o.ms for o in options) for options in blocks))
    assert points[0].kept_bytes == min(
        sum(blocks[b][k].kept_bytes for b, k in enumerate(p.choice)) for p in points
    )
    assert points[0].kept_bytes <= sum(min(o.kept_bytes for o in options) for options in blocks) + (
        16 * sum(max(o.kept_bytes for o in options) for options in blocks) / 512
    )


def test_a_block_without_options_is_refused():
    with pytest.raises(ValueError, match="at least one option"):
        front([[Option("store", 1, 1.0)], []])
