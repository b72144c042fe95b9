"""jaxoffload.cut: the cheapest residuals, against exhaustive search on small programs."""

import itertools

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.extend import core as jex_core

from jaxoffload._src import cut, jaxprs

# Operations of the random programs: (name, arity, function).
OPS = [
    ("sin", 1, jnp.sin),
    ("exp", 1, jnp.exp),
    ("mul", 2, jnp.multiply),
    ("add", 2, jnp.add),
    ("sum", 1, lambda x: jnp.broadcast_to(x.sum(0, keepdims=True), x.shape)),
    ("dot", 2, lambda a, b: a @ b),
]


@st.composite
def programs(draw):
    """A straight-line program over two 8x8 inputs, and which of its values are needed."""
    steps = draw(st.lists(st.tuples(st.integers(0, len(OPS) - 1), st.integers(0, 99),
                                    st.integers(0, 99)), min_size=2, max_size=7))  # fmt: skip
    needed = draw(st.lists(st.integers(0, 99), min_size=1, max_size=3))
    free_input = draw(st.booleans())
    return steps, needed, free_input


def _trace(steps, needed):
    def f(x, y):
        values = [x, y]
        for op, a, b in steps:
            _, arity, fun = OPS[op]
            args = [values[a % len(values)], values[b % len(values)]][:arity]
            values.append(fun(*args))
        return [values[2 + n % len(steps)] for n in needed]

    return jax.make_jaxpr(f)(jnp.ones((8, 8)), jnp.ones((8, 8))).jaxpr


def _objective(jaxpr, needed, free, saved):
    """The cut's cost of keeping ``saved``, or None if the needed values cannot be rebuilt."""
    producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    recomputed = cut.ancestors(jaxpr, needed, set(saved))
    for i in recomputed:
        for u in jaxpr.eqns[i].invars:
            if isinstance(u, jex_core.Var) and u not in saved and u not in producer:
                return None  # an input that was not kept
    every = cut.prices(jaxpr, needed)
    prices = [every[i] for i in recomputed]
    if any(p.never or p.flops for p in prices):  # no budget for products
        return None
    kept = sum(0 if v in free else max(1, jaxprs.nbytes(v.aval)) for v in saved)
    return kept + sum(1e-3 + p.passes for p in prices)


@settings(deadline=None, max_examples=40, derandomize=True)
@given(programs())
def test_the_cut_is_the_cheapest_that_rebuilds_what_is_needed(program):
    steps, needed_ids, free_input = program
    jaxpr = _trace(steps, needed_ids)
    needed = [v for v in jaxpr.outvars if isinstance(v, jex_core.Var)]
    free = {jaxpr.invars[0]} if free_input else set()
    chosen = cut.cheapest_cut(jaxpr, needed, free, max_recompute=0.0)
    got = _objective(jaxpr, needed, free, set(chosen.saved))
    assert got is not None, "the cut cannot rebuild a needed value"
    candidates = list(dict.fromkeys([*jaxpr.invars, *(v for e in jaxpr.eqns for v in e.outvars)]))
    best = min(
        cost
        for k in range(len(candidates) + 1)
        for subset in itertools.combinations(candidates, k)
        if (cost := _objective(jaxpr, needed, free, set(subset))) is not None
    )
    assert got == pytest.approx(best, rel=1e-9, abs=1e-6)


def test_a_budget_recomputes_the_product_that_saves_the_most():
    # Two products of equal FLOPs per byte; a budget that fits one takes the one
    # whose output is larger.
    def f(x, small, large):
        return [jnp.sin(x @ small), jnp.sin(x @ large)]

    jaxpr = jax.make_jaxpr(f)(jnp.ones((64, 8)), jnp.ones((8, 4)), jnp.ones((8, 16))).jaxpr
    needed = [e.invars[0] for e in jaxpr.eqns if e.primitive.name == "sin"]  # the products
    free = set(jaxpr.invars)
    within = cut.cheapest_cut(jaxpr, needed, free, max_recompute=0.85)
    assert [v.aval.shape for v in within.saved if v not in free] == [(64, 4)]
    assert within.recompute_flops == 2 * 64 * 8 * 16
    assert cut.cheapest_cut(jaxpr, needed, free, max_recompute=0.0).recompute_flops == 0
    everything = cut.cheapest_cut(jaxpr, needed, free, max_recompute=1.0)
    assert [v for v in everything.saved if v not in free] == []


def test_a_depthwise_convolution_is_priced_by_its_passes_and_kept():
    """Its few FLOPs would make it the first thing recomputed; at memory speed it costs
    a pass over its input and output, more than keeping its output."""

    def f(x, w):
        y = jax.lax.conv_general_dilated(
            jnp.sin(x), w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
            feature_group_count=8,
        )  # fmt: skip
        return [jnp.cos(y), jnp.sin(x)]

    jaxpr = jax.make_jaxpr(f)(jnp.ones((2, 8, 8, 8)), jnp.ones((3, 3, 1, 8))).jaxpr
    (conv,) = [e for e in jaxpr.eqns if e.primitive.name == "conv_general_dilated"]
    assert cut.price(conv).flops == 0 and cut.price(conv).passes > 0
    chosen = cut.cheapest_cut(jaxpr, jaxpr.outvars, set(jaxpr.invars), max_recompute=1.0)
    assert conv.outvars[0] in chosen.saved or jaxpr.outvars[0] in chosen.saved
    assert not any(jaxpr.eqns[i] is conv for i in chosen.recomputed)


def test_a_products_input_made_by_a_polynomial_transcendental_is_kept():
    """GELU's output, the second 1x1's input, is kept: recomputing it would run erfc in a
    kernel of its own, apart from the derivative's. A ReLU, SiLU (its logistic function is
    an instruction or two) and a tanh over a smaller tensor (a gate over a statistic) make
    nothing kept, nor does a statistic's rsqrt."""

    def f(x, w1, w2, w3):
        h = x @ w1
        mean = h.mean(-1, keepdims=True)
        normed = (h - mean) * jax.lax.rsqrt(((h - mean) ** 2).mean(-1, keepdims=True) + 1e-6)
        gelu = jax.nn.gelu(normed @ w2, approximate=False)
        relu = jnp.maximum(gelu @ w3, 0.0)
        gate = jnp.tanh(relu.mean(0, keepdims=True))
        return [jax.nn.silu(relu @ w3.T) @ w3, (relu * gate) @ w3.T]

    shapes = [(64, 16), (16, 16), (16, 64), (64, 16)]
    jaxpr = jax.make_jaxpr(f)(*[jnp.ones(s) for s in shapes]).jaxpr
    # The backward pass reads what each product reads, as jax.vjp's residuals.
    products = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    needed = list(dict.fromkeys(e.invars[0] for e in products))
    chosen = cut.cheapest_cut(jaxpr, needed, set(jaxpr.invars), max_recompute=0.0)
    reasons = {jaxpr.eqns[i].outvars[0]: why for i, why in chosen.never.items()}
    gelu_out = products[2].invars[0]
    assert reasons == {gelu_out: "a product's input, made by erfc"}
    assert gelu_out in chosen.saved
    assert len(products) == 6  # the SiLU's output (products[4]) and the gated one: not kept


def test_effects_and_unknown_primitives_are_never_recomputed():
    from jax.experimental import io_callback

    def f(x):
        y = io_callback(lambda y: y, jax.ShapeDtypeStruct((4, 4), jnp.float32), jnp.sin(x),
                        ordered=True)  # fmt: skip
        return [jnp.sin(y), jnp.linalg.cholesky(y @ y.T + 10 * jnp.eye(4))]

    jaxpr = jax.make_jaxpr(f)(jnp.ones((4, 4))).jaxpr
    chosen = cut.cheapest_cut(jaxpr, jaxpr.outvars, set(jaxpr.invars), max_recompute=10.0)
    assert set(chosen.saved) == set(jaxpr.outvars)  # kept: neither can be recomputed
    reasons = " ".join(chosen.never.values())
    assert "no recomputation rule for cholesky" in reasons and "has effects" in reasons
    with pytest.raises(ValueError, match="non-negative"):
        cut.cheapest_cut(jaxpr, jaxpr.outvars, max_recompute=-1)


def test_a_repeated_program_is_solved_once_and_mapped_onto_each_trace(monkeypatch):
    from jaxoffload._src.jaxprs import trace_vjp

    def block(x, w):
        return jnp.tanh(jnp.sin(x) @ w) * x

    solved = cut.SolvedCuts()  # none solved yet, as in a fresh process
    monkeypatch.setattr(cut, "SOLVED", solved)
    x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
    cuts = []
    for _ in range(2):  # two traces: the same program, new variables
        traced = trace_vjp(block, x, w)
        kept = cut.cheapest_cut(traced.jaxpr, traced.needed, traced.jaxpr.invars[1:])
        mine = {*traced.jaxpr.invars, *(v for e in traced.jaxpr.eqns for v in e.outvars)}
        assert kept.saved and set(kept.saved) <= mine
        cuts.append([str(v.aval) for v in kept.saved])
    assert solved.solves == 1 and cuts[0] == cuts[1]
