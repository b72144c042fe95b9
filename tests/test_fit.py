"""jaxoffload.largest_size: the size search against stand-in bytes, and on a model on CPU."""

import math

import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxoffload
from jaxoffload import Lean, Remat
from jaxoffload._src.planner.bracket import largest_fitting
from jaxoffload._src.planner.size_steps import SizeSteps, leanest_within
from tests.test_plan import PLANNABLE, VARIABLES, Block, Net, step


class Counted:
    """A stand-in for compiled bytes that counts its calls."""

    def __init__(self, bytes_at):
        self.bytes_at, self.calls = bytes_at, []

    def __call__(self, size):
        self.calls.append(size)
        return self.bytes_at(size)


@settings(max_examples=200, deadline=None)
@given(
    fixed=st.integers(0, 10**6),
    per_item=st.integers(1, 10**4),
    budget=st.integers(1, 10**8),
    start=st.integers(1, 4096),
)
def test_an_affine_step_is_resolved_to_within_the_tolerance_in_few_compiles(
    fixed, per_item, budget, start
):
    bytes_at = Counted(lambda b: fixed + per_item * b)
    size, stopped = largest_fitting(bytes_at, budget, start=start, limit=4096, tolerance=0.02)
    exact = min(4096, max(0, (budget - fixed) // per_item))
    assert stopped is None
    assert size <= exact and size >= exact * 0.98 - 1
    assert size == 0 or bytes_at(size) <= budget
    assert len(set(bytes_at.calls)) <= 8


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2000), min_size=64, max_size=64), st.integers(1, 64))
def test_the_answer_is_always_a_size_that_was_compiled_and_fits(noise, start):
    """Bytes that are not monotone in the size: nothing is inferred from neighbours."""
    bytes_at = Counted(lambda b: 100 * b + noise[b - 1])
    size, _ = largest_fitting(bytes_at, 3000, start=start, limit=64)
    assert size == 0 or (size in bytes_at.calls and bytes_at(size) <= 3000)


def test_where_the_bytes_stop_growing_the_search_steps_rather_than_leaps():
    """XLA rematerialises a step to fit the device: its bytes flatten just under the budget
    up to an edge that no line predicts, and a compile far past that edge is the slowest."""
    bytes_at = Counted(lambda b: 100 * b if b <= 500 else 49_000 + b if b <= 560 else 100 * b)
    size, stopped = largest_fitting(bytes_at, 50_000, start=256, limit=4096)
    assert stopped is None and 560 * 0.98 <= size <= 560
    assert max(bytes_at.calls) <= 640 and len(set(bytes_at.calls)) <= 10


def test_the_second_probe_is_where_proportional_bytes_meet_the_budget():
    bytes_at = Counted(lambda b: 100 * b)
    largest_fitting(bytes_at, 15_000, start=100, limit=4096)
    assert bytes_at.calls[:2] == [100, 150]


def test_every_probe_is_a_multiple():
    bytes_at = Counted(lambda side: 50 * side * side)
    size, _ = largest_fitting(bytes_at, 10**6, start=64, limit=1024, multiple_of=16)
    assert all(s % 16 == 0 for s in bytes_at.calls)
    assert size == 128  # 50 * 144**2 is over the budget, 50 * 128**2 is not


def test_nothing_fits():
    assert largest_fitting(lambda b: 10 + b, 5, start=8, limit=64) == (0, None)


def test_no_size_below_the_smallest_is_probed():
    bytes_at = Counted(lambda side: side * side)
    assert largest_fitting(bytes_at, 500, start=64, limit=512, multiple_of=16, smallest=32) == (
        0,
        None,
    )
    assert min(bytes_at.calls) == 32
    assert (
        largest_fitting(bytes_at, 2000, start=64, limit=512, multiple_of=16, smallest=32)[0] == 32
    )


def test_the_time_limit_stops_the_search_with_the_largest_known_fit():
    calls = []
    size, stopped = largest_fitting(
        lambda b: calls.append(b) or 100 * b, 10**6, start=8, limit=4096,
        out_of_time=lambda size: len(calls) >= 2,
    )  # fmt: skip
    assert size == 64 and "time limit" in stopped  # 8 fits, and 8 times it


def test_a_search_stopped_by_its_time_limit_compiles_nothing_more_and_gives_its_bracket():
    """The time left is asked before each compile, with its size: one it refuses never starts."""
    bytes_at, asked = Counted(lambda side: side * side), []

    def out_of_time(size):
        asked.append(size)
        return len(bytes_at.calls) >= 3

    size, stopped = largest_fitting(bytes_at, 10_000, start=8, limit=4096, out_of_time=out_of_time)
    assert bytes_at.calls == [8, 64, 146] and asked[-1] not in bytes_at.calls
    assert size == 64
    assert (
        stopped == f"stopped at the time limit, before checking {asked[-1]}: 64 fits, 146 does not"
    )


def args_at(batch):
    x = jnp.zeros((batch, 16, 16, 3))
    return VARIABLES["params"], VARIABLES["batch_stats"], x, jnp.zeros((batch,), jnp.int32)


def bytes_of(batch):
    probe = SizeSteps(Net(), step, args_at, 1, False, {"donate_argnums": ()})
    return probe.compiled_bytes(batch)


BUDGET = (bytes_of(8) + bytes_of(16)) // 2


def test_the_largest_batch_of_a_model_fits_and_the_next_does_not():
    found = jaxoffload.largest_size(Net(), step, args_at, budget=BUDGET, start=4, progress=False)
    probes = dict(found.probes)
    assert 8 < found.size < 16 and probes[found.size] <= BUDGET
    assert found.compiled_bytes == probes[found.size]
    over = [s for s, b in probes.items() if b > BUDGET]
    assert min(over) <= found.size * 1.02 + 1
    assert (found.fits_at, found.over_at) == (found.size, min(s for s in over if s > found.size))
    assert found.step_ms > 0 and found.per_second > 0
    # A CPU reports no runtime peak: the size is checked by its compiled bytes alone.
    assert not found.confirmed and found.peak_bytes is None
    assert (
        found.stopped
        == "no runtime peak was read: this cpu device reports none, so the size is checked by its compiled bytes alone"
    )


def test_a_size_whose_step_runs_out_of_memory_steps_down(monkeypatch):
    confirm = SizeSteps.confirm
    failed = []

    def out_of_memory_once(self, size, left_s):
        if not failed:
            failed.append(size)
            return None
        return confirm(self, size, left_s)

    monkeypatch.setattr(SizeSteps, "confirm", out_of_memory_once)
    found = jaxoffload.largest_size(Net(), step, args_at, budget=BUDGET, start=4, progress=False)
    assert found.size < failed[0] and "no runtime peak was read" in found.stopped


def test_with_a_plan_the_size_is_the_largest_that_some_plan_fits():
    lines = []
    found = jaxoffload.largest_size(
        PLANNABLE, step, args_at, budget=BUDGET, plan=True, start=8, runs=1, progress=lines.append
    )
    assert found.plan is not None and found.plan.compiled_bytes <= BUDGET
    assert found.compiled_bytes == found.plan.compiled_bytes
    # The block costs were measured once, at the start, and rescaled to every other size.
    assert sum("block programs by their FLOPs" in line for line in lines) == 1


def test_no_compile_outlives_a_planned_size_search():
    """The first size's planner compiles its hidden offloads' check in the background: a search
    that ends before any round waits for it (nothing fits) still waits for it before returning."""
    import threading

    before = set(threading.enumerate())
    found = jaxoffload.largest_size(
        PLANNABLE, step, args_at, budget=bytes_of(1) + 1, plan=True, start=8, smallest=8,
        runs=1, options=(jaxoffload.Store(), Lean(), Remat(), jaxoffload.Offload()),
        progress=False,
    )  # fmt: skip
    assert found.size == 0
    assert [t for t in threading.enumerate() if t not in before and t.is_alive()] == []


def _plannable_steps(min_speed=None, say=lambda _: None):
    return SizeSteps(PLANNABLE, step, args_at, BUDGET, True, {
        "blocks": None, "options": None, "runs": 1, "donate_argnums": (), "say": say
    }, min_speed)  # fmt: skip


def test_the_leanest_plan_within_a_time_is_the_first_on_the_front_that_the_model_puts_there():
    steps = _plannable_steps()
    steps.compiled_bytes(8)
    planner = steps.planner_at(8)
    added = [planner.ms(planner.candidate(p)) - planner.ms(planner.plain) for p in planner.front]
    assert leanest_within(planner, math.inf) == planner.candidate(planner.front[0])
    assert leanest_within(planner, min(added) - 1.0) is None  # none is that fast
    between = sorted(added)[len(added) // 2]
    first = next(i for i, e in enumerate(added) if e <= between)
    assert leanest_within(planner, between) == planner.candidate(planner.front[first])


def test_with_a_speed_floor_a_plan_slower_than_it_is_refused(monkeypatch):
    lines = []
    monkeypatch.setattr(SizeSteps, "slowest_ms", lambda self, size: 0.0)  # nothing is fast
    steps = _plannable_steps(min_speed=0.5, say=lines.append)
    steps.compiled_bytes(8)
    assert steps.confirm(8) is None
    assert any("slower than 0.5 of the plain step's speed" in line for line in lines)


def test_with_a_speed_floor_the_plan_found_keeps_it():
    found = jaxoffload.largest_size(
        PLANNABLE, step, args_at, budget=BUDGET, plan=True, min_speed=1e-3, start=8, runs=1,
        progress=False,
    )  # fmt: skip
    assert found.plan is not None and found.plan.compiled_bytes <= BUDGET
    assert not found.confirmed and "no runtime peak was read" in found.stopped


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"budget": 10**6, "min_speed": 0.7}, "with plan=True"),
        ({"budget": 10**6, "plan": True, "min_speed": 1.5}, "min_speed"),
        ({"budget": 0.5}, "bytes"),
        ({"budget": 10**6, "multiple_of": 0}, "multiple_of"),
        ({"budget": 10**6, "start": 10, "limit": 5}, "start"),
        ({"budget": 10**6, "tolerance": 0}, "tolerance"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error):
    with pytest.raises((TypeError, ValueError), match=error):
        jaxoffload.largest_size(Net(), step, args_at, progress=False, **kwargs)


def test_at_a_size_far_past_the_budget_the_plain_step_is_compiled_only_when_needed():
    """A size search probes sizes whose plain step cannot fit: it compiles their leanest plan."""
    steps = SizeSteps(PLANNABLE, step, args_at, BUDGET, True, {
        "blocks": None, "options": None, "runs": 1, "donate_argnums": (), "say": lambda _: None
    })  # fmt: skip
    steps.compiled_bytes(8)  # the block costs, measured once
    lines = []
    steps.planning["say"] = lines.append
    far = steps.planner_at(64)  # its plain step: 8 times size 8's, about 5 budgets
    assert far.plain not in far.compiled and len(far.compiled) <= 2
    # The least plan at the measured size is compiled here too: the model, fitted at 8,
    # may misjudge which plan is leanest at 64.
    measured = steps.planner_at(8)
    assert min(measured.compiled, key=measured.compiled.__getitem__) in far.compiled
    assert any("not compiled" in line for line in lines)
    assert far.anchor in far.compiled
    # A share of the plain step needs it: it is compiled then.
    far.plan_for(1.0)
    assert far.plain in far.compiled


@pytest.mark.parametrize("start, fits", [(4, True), (16, False)])
def test_a_size_search_stopped_by_its_time_limit_gives_its_bracket(start, fits):
    """With no time at all, the first size compiles and nothing else: the answer says so."""
    found = jaxoffload.largest_size(
        Net(), step, args_at, budget=BUDGET, start=start, time_limit_s=0, progress=False
    )
    assert [size for size, _ in found.probes] == [start]
    assert found.stopped.startswith("stopped at the time limit, before checking ")
    if fits:
        assert (found.size, found.fits_at, found.over_at) == (start, start, None)
        assert f"{start} fits, nothing above it was checked" in found.stopped
        assert str(found).startswith(f"size {start}: {start} compiled within ")
    else:
        assert (found.size, found.fits_at, found.over_at) == (0, None, start)
        assert found.stopped.endswith(f"no size fitted yet, {start} does not")
        assert str(found).startswith(f"size 0: nothing compiled within 2.2 MiB, {start} over it")


def test_a_planned_search_compiles_the_plain_step_past_its_largest_size_only_once():
    """With a plan, the plain step is a time reference, and one over the budget runs nowhere:
    past the size where it compiled over, it is not compiled again (it was at every size)."""
    lines = []
    found = jaxoffload.largest_size(
        PLANNABLE, step, args_at, budget=bytes_of(48), plan=True, start=48, runs=1,
        progress=lines.append,
    )  # fmt: skip
    plain = [line for line in lines if line.startswith("plain step: ")]
    over = [line for line in plain if "too large to run here" in line]
    assert len(over) == 1 and any("not compiled" in line for line in plain), plain
    assert found.plan is not None and found.size >= 48


def test_a_planned_size_is_never_below_the_best_uniform_strategys():
    """Each size is checked first with the least plan compiled at the first size that keeps
    the speed floor (a uniform one), so no leaner guess of the model can lose to it."""
    budget = bytes_of(48)
    uniform = {
        name: jaxoffload.largest_size(
            model, step, args_at, budget=budget, start=48, progress=False
        ).size
        for name, model in [
            ("Store", Net()),
            ("Lean", Net(block=jaxoffload.linen.wrap(Block, Lean()))),
            ("Remat", Net(block=jaxoffload.linen.wrap(Block, Remat()))),
        ]
    }
    found = jaxoffload.largest_size(
        PLANNABLE, step, args_at, budget=budget, plan=True, min_speed=1e-3, start=8, runs=1,
        progress=False,
    )  # fmt: skip
    assert found.size >= max(uniform.values()), (found.size, uniform)
