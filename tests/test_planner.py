"""jaxoffload.bench.reference_hidden: which blocks' transfers hide behind compute."""

import itertools

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxoffload
from jaxoffload.bench import models
from jaxoffload.bench.planning import hidden_offload_workload, time_offloaded_calls
from jaxoffload.bench.reference_hidden import choose_hidden_offload
from jaxoffload.bench.step import train_step
from jaxoffload.bench.workload import Workload

LINK = {"d2h_gbps": 50.0, "h2d_gbps": 40.0}


@settings(max_examples=200, deadline=None)
@given(
    block_bytes=st.lists(st.integers(0, 10**9), min_size=1, max_size=20),
    fwd_ms=st.floats(0.1, 100),
    bwd_ms=st.floats(0.1, 200),
    weights=st.none() | st.lists(st.integers(1, 100), min_size=20, max_size=20),
)
def test_every_planned_transfer_fits_behind_its_neighbours(block_bytes, fwd_ms, bwd_ms, weights):
    n = len(block_bytes)
    flops = None if weights is None else weights[:n]
    plan = choose_hidden_offload(
        block_bytes, block_costs=flops, fwd_ms=fwd_ms, bwd_ms=bwd_ms, **LINK
    )
    w = plan.window
    share = [f / sum(flops) for f in flops] if flops else [1 / n] * n
    chosen = [i for i, c in enumerate(plan.offload) if c]
    assert len(plan.offload) == n
    assert plan.offloaded_bytes == sum(block_bytes[i] for i in chosen)
    if not chosen:
        return
    # Transfers never share the link, and each has w - 1 later blocks to hide behind.
    assert all(b - a >= w for a, b in zip(chosen, chosen[1:]))
    assert chosen[-1] <= n - w
    for i in chosen:
        fwd, bwd = fwd_ms * sum(share[i + 1 : i + w]), bwd_ms * sum(share[i + 1 : i + w])
        assert block_bytes[i] / (LINK["d2h_gbps"] * 1e6) <= 0.8 * fwd * (1 + 1e-9)
        assert block_bytes[i] / (LINK["h2d_gbps"] * 1e6) <= 0.8 * bwd * (1 + 1e-9)


@settings(max_examples=150, deadline=None)
@given(
    blocks=st.lists(
        st.tuples(st.integers(1, 10**8), st.integers(0, 10**9), st.floats(0, 2)),
        min_size=1,
        max_size=8,
    ),
    max_extra_ms=st.floats(0, 4),
)
def test_plan_frees_the_most_within_its_recomputation_budget(blocks, max_extra_ms):
    moved, freed, extra = map(list, zip(*blocks))
    times = {"fwd_ms": 10.0, "bwd_ms": 20.0, "margin": 1.0, "max_window": 3}
    plan = choose_hidden_offload(
        moved, freed_bytes=freed, extra_ms=extra, max_extra_ms=max_extra_ms, **times, **LINK
    )
    chosen = [i for i, c in enumerate(plan.offload) if c]
    assert plan.freed_bytes == sum(freed[i] for i in chosen)
    assert plan.extra_ms <= max_extra_ms * (1 + 1e-9)

    # Against every subset, at every window: the same rules, searched exhaustively.
    def fits(i, w):
        n = len(moved)
        fwd, bwd = 10.0 * (w - 1) / n, 20.0 * (w - 1) / n
        return i <= n - w and moved[i] <= min(fwd * LINK["d2h_gbps"], bwd * LINK["h2d_gbps"]) * 1e6

    best = 0
    for w in (2, 3):
        for subset in itertools.product((False, True), repeat=len(moved)):
            picked = [i for i, p in enumerate(subset) if p]
            if (
                all(fits(i, w) and freed[i] > 0 for i in picked)
                and all(b - a >= w for a, b in zip(picked, picked[1:]))
                and sum(extra[i] for i in picked) <= max_extra_ms
            ):
                best = max(best, sum(freed[i] for i in picked))
    assert plan.freed_bytes == best


def test_cheap_neighbours_hide_less():
    # Equal shares hide block 2's transfer; with its neighbours nearly free, nothing does.
    sizes, times = [0, 0, 10**8, 0, 0, 0], {"fwd_ms": 10, "bwd_ms": 20}
    assert choose_hidden_offload(sizes, **times, **LINK).offload[2]
    cheap = choose_hidden_offload(sizes, block_costs=[100, 100, 1, 1, 1, 1], **times, **LINK)
    assert not any(cheap.offload)


def test_no_block_fits_means_no_offload():
    plan = choose_hidden_offload([10**12] * 8, fwd_ms=1, bwd_ms=2, **LINK)
    assert plan.offload == (False,) * 8 and plan.offloaded_bytes == 0


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="margin"):
        choose_hidden_offload([1], fwd_ms=1, bwd_ms=1, margin=0, **LINK)
    with pytest.raises(ValueError, match="fwd_ms must be positive"):
        choose_hidden_offload([1], fwd_ms=0, bwd_ms=1, **LINK)
    with pytest.raises(ValueError, match="freed_bytes must give 1"):
        choose_hidden_offload([1], freed_bytes=[], fwd_ms=1, bwd_ms=1, **LINK)
    for flops in ([1, 2], [0], [-1]):
        with pytest.raises(ValueError, match="block_costs must give 1"):
            choose_hidden_offload([1], block_costs=flops, fwd_ms=1, bwd_ms=1, **LINK)


def test_hidden_workload_plans_from_each_blocks_residual_bytes():
    workload = Workload("vgg11", 2, 32, "float32", "offload-hidden")
    with pytest.raises(ValueError, match="needs a plan"):
        _ = workload.block_strategies
    # A fast link: every block fits, except the last, which has no block after
    # it to hide behind; chosen blocks are a window apart.
    planned = hidden_offload_workload(
        workload, fwd_ms=10.0, bwd_ms=20.0, d2h_gbps=1e6, h2d_gbps=1e6
    )
    chosen = [i for i, s in enumerate(planned.block_names) if s == "offload"]
    assert planned.window == 2 and set(planned.block_names) == {"lean", "offload"}
    assert len(chosen) >= 3 and 7 not in chosen
    assert all(b - a >= planned.window for a, b in zip(chosen, chosen[1:]))
    assert planned.block_strategies[chosen[0]] == jaxoffload.Offload(window=2)


def test_offloaded_calls_count_each_blocks_convolutions():
    step, state, batch, _ = train_step(
        Workload("vgg11", 2, 32, "float32", "offload"), abstract=True
    )
    calls = jaxoffload.offloaded_calls(step, state, batch)
    # vgg11: (channels in, channels out, resolution) of each 3x3 convolution.
    convs = [(3, 64, 32), (64, 128, 16), (128, 256, 8), (256, 256, 8), (256, 512, 4),
             (512, 512, 4), (512, 512, 2), (512, 512, 2)]  # fmt: skip
    assert [c.flops for c in calls] == [2 * 2 * r * r * 9 * i * o for i, o, r in convs]


def test_residuals_per_call_gives_one_list_per_block():
    step, state, batch, _ = train_step(
        Workload("resnet18", 2, 32, "bfloat16", "offload"), abstract=True
    )
    # The stem, under Remat() where every block offloads, is a wrapped call too: the first.
    stem, *calls = jaxoffload.residuals_per_call(step, state, batch)
    assert len(calls) == models.num_blocks("resnet18")
    assert all(r.placement == "device" for r in stem)
    for call in calls:
        host = [r for r in call if r.placement == "pinned_host"]
        assert host and all(r.dtype in (jnp.bfloat16, jnp.float32, jnp.int8) for r in host)


def test_each_call_is_timed_alone_and_equal_programs_once():
    layer = jaxoffload.offload(lambda w, x: jnp.tanh(x @ w), device_argnums=0)
    wide = jaxoffload.offload(lambda w, x: jnp.tanh(x @ w) @ w.T, device_argnums=0)
    step = jax.grad(lambda w, x: wide(w, layer(w, layer(w, x))).sum())
    calls = jaxoffload.offloaded_calls(step, jnp.ones((64, 64)), jnp.ones((32, 64)))
    times = time_offloaded_calls(calls, runs=2)
    assert len(times) == 3 and min(times) > 0
    assert times[0] == times[1]  # one program, timed once
