"""jaxoffload.layers.max_pool: flax's values and gradients, without index tensors."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from helpers import rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxoffload.layers import max_pool


@settings(deadline=None, max_examples=25)
@given(
    batch=st.integers(1, 3),
    height=st.integers(2, 11),
    width=st.integers(2, 11),
    channels=st.integers(1, 4),
    window=st.sampled_from([(2, 2), (3, 3), (2, 1), (1, 3), (3, 2)]),
    seed=st.integers(0, 2**16),
)
def test_matches_flax_max_pool(batch, height, width, channels, window, seed):
    window = tuple(min(w, s) for w, s in zip(window, (height, width)))
    x = jax.random.normal(jax.random.key(seed), (batch, height, width, channels))
    ours = lambda x: max_pool(x, window, window)  # noqa: E731
    flax = lambda x: nn.max_pool(x, window, strides=window)  # noqa: E731
    assert rel_err(ours(x), flax(x)) == 0.0
    ct = jax.random.normal(jax.random.key(seed + 1), flax(x).shape)
    grad = lambda f: jax.jit(jax.grad(lambda x: jnp.sum(f(x) * ct)))(x)  # noqa: E731
    assert rel_err(grad(ours), grad(flax)) <= 1e-6


def test_ties_go_to_the_first_element_of_the_window():
    x = jnp.array([[1.0, 1.0], [1.0, 0.0]]).reshape(1, 2, 2, 1)
    g = jax.grad(lambda x: max_pool(x, (2, 2), (2, 2)).sum())(x)
    np.testing.assert_array_equal(g[0, :, :, 0], [[1.0, 0.0], [0.0, 0.0]])


def test_backward_keeps_no_input_sized_index_tensor():
    x = jnp.ones((2, 8, 8, 4), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(
        jax.grad(lambda x: max_pool(x, (2, 2), (2, 2)).astype(jnp.float32).sum())
    )(x)
    integer_shapes = {
        v.aval.shape
        for eqn in jaxpr.jaxpr.eqns
        for v in eqn.outvars
        if jnp.issubdtype(v.aval.dtype, jnp.integer)
    }
    assert integer_shapes <= {(2, 4, 4, 4)}  # one small index per pooled element at most
    assert "select_and_scatter" not in str(jaxpr) and "select_and_gather" not in str(jaxpr)


def test_overlapping_windows_fall_back_to_flax():
    x = jax.random.normal(jax.random.key(0), (1, 6, 6, 2))
    for kwargs in ({"strides": (1, 1)}, {"strides": (2, 2), "padding": "SAME"}):
        np.testing.assert_array_equal(
            max_pool(x, (3, 3), **kwargs), nn.max_pool(x, (3, 3), **kwargs)
        )
