"""What works under which transform: each cell of the README's table, against the plain model.

Rows: forward mode (``jax.jvp``, ``jax.jacfwd``), second order (a gradient of a
gradient, ``jax.hessian``), Flax's ``nn.scan`` and ``nn.vmap``, and donation; the
sharding row is ``tests/test_sharding.py``'s. Columns: the strategies.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from helpers import every_strategy_value, host_device_puts, normal, rel_err
from jax.ad_checkpoint import checkpoint_name

import jaxoffload
from jaxoffload import Lean, Offload, Remat, Store

STRATEGIES = every_strategy_value()
W, X = 0.3 * normal(0, (3, 3, 4, 4)), normal(1, (2, 8, 8, 4))


def _block(w, x):
    """A convolution, a ReLU and a max-pool: kept residuals of three kinds, an int8 one too."""
    y = jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    y = nn.relu(jnp.tanh(y))
    return nn.max_pool(y, (2, 2), (2, 2), padding="SAME")


def _model(block):
    """Two calls of ``block``, so that windows and chains have a later call to wait for."""
    return lambda w, x: jnp.sum(block(w, block(w, x)) ** 2)


@pytest.mark.parametrize("strategy", [Store(), Remat()], ids=repr)
def test_forward_mode_works_under_store_and_remat(strategy):
    f = _model(jaxoffload.wrap(_block, strategy, device_argnums=0))
    plain = _model(_block)
    tangent = normal(2, X.shape)
    _, ours = jax.jit(lambda x, t: jax.jvp(lambda x: f(W, x), (x,), (t,)))(X, tangent)
    _, ref = jax.jit(lambda x, t: jax.jvp(lambda x: plain(W, x), (x,), (t,)))(X, tangent)
    assert rel_err(ours, ref) <= 1e-5
    columns = jax.jacfwd(lambda w: f(w, X))(W)
    assert rel_err(columns, jax.jacfwd(lambda w: plain(w, X))(W)) <= 1e-5


@pytest.mark.parametrize("strategy", [Lean(), Offload()], ids=repr)
def test_forward_mode_is_refused_under_lean_and_offload(strategy):
    f = _model(jaxoffload.wrap(_block, strategy, device_argnums=0))
    message = (
        rf"differentiate in forward mode, which _block, wrapped with {type(strategy).__name__}"
    )
    with pytest.raises(TypeError, match=message + r".*wrap it with Remat\(\) or Store\(\)"):
        jax.jvp(lambda x: f(W, x), (X,), (X,))
    with pytest.raises(TypeError, match=message):
        jax.jacfwd(lambda w: f(w, X))(W)
    # Under jit too, where jax itself would say so only when lowering, in its own words.
    with pytest.raises(TypeError, match=message):
        jax.jit(lambda x: jax.jvp(lambda x: f(W, x), (x,), (x,)))(X)
    with pytest.raises(TypeError, match=message):
        jax.jit(jax.hessian(lambda x: f(W, x).sum()))(X)


@pytest.mark.parametrize("strategy", [*STRATEGIES, Offload(names=("a",))], ids=repr)
def test_a_gradient_of_a_gradient_is_the_plain_one(strategy):
    # Under Offload it failed inside jax: a zero tangent or cotangent of a host copy
    # was made in device memory (`Expected cotangent type float32[4,8] but got
    # float32<host>[4,8]`), even on CPU, where nothing moves.
    def block(w, x):
        return _block(w, checkpoint_name(x, "a"))

    f, plain = _model(jaxoffload.wrap(block, strategy, device_argnums=0)), _model(_block)

    def second(f):  # d/dw of |d f / dx|^2
        return lambda w: jnp.sum(jax.grad(f, argnums=1)(w, X) ** 2)

    ref = jax.jit(jax.grad(second(plain)))(W)
    assert rel_err(jax.jit(jax.grad(second(f)))(W), ref) <= 1e-5
    # The inner gradient jitted apart, and the outer differentiating its program.
    inner = jax.jit(jax.grad(f, argnums=1))
    assert rel_err(jax.grad(lambda w: jnp.sum(inner(w, X) ** 2))(W), ref) <= 1e-5
    # The host copies stay in the second-order program: as many as the first-order one's, or more.
    first = host_device_puts(jax.make_jaxpr(jax.grad(f))(W, X))
    moves = host_device_puts(jax.make_jaxpr(jax.grad(second(f)))(W))
    assert (first > 0 and moves >= first) if strategy.to_host else moves == first == 0


@pytest.mark.parametrize("strategy", STRATEGIES, ids=repr)
def test_the_hessian_reverse_over_reverse_is_the_plain_one(strategy):
    small = normal(3, (1, 2, 2, 4))
    f = _model(jaxoffload.wrap(_block, strategy, device_argnums=0))
    ref = jax.jit(jax.hessian(lambda x: _model(_block)(W, x)))(small)
    assert rel_err(jax.jit(jax.jacrev(jax.jacrev(lambda x: f(W, x))))(small), ref) <= 1e-5
    # jax.hessian is forward over reverse: it differentiates forward the lean ReLU and max-pool
    # rules (custom_vjp rules too) that a cutting strategy (Lean, Offload) puts in the forward
    # pass. Store, Remat and Offload(recompute=True) put none there.
    if strategy.cuts:
        with pytest.raises(TypeError, match=r"for second order, go reverse over reverse"):
            jax.hessian(lambda x: f(W, x))(small)
    else:
        assert rel_err(jax.jit(jax.hessian(lambda x: f(W, x)))(small), ref) <= 1e-5


class _Cell(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.relu(nn.Dense(8)(x)) + x, None


def _scanned(cell):
    class Scanned(nn.Module):
        @nn.compact
        def __call__(self, x):
            split = {"variable_axes": {"params": 0}, "split_rngs": {"params": True}}
            return nn.scan(cell, **split, length=3)()(x, None)[0]

    return Scanned()


def _vmapped(cell):
    class Vmapped(nn.Module):
        @nn.compact
        def __call__(self, x):
            shared = {"variable_axes": {"params": None}, "split_rngs": {"params": False}}
            return nn.vmap(cell, **shared, in_axes=(0, None))()(x, None)[0]

    return Vmapped()


@pytest.mark.parametrize("lift", [_scanned, _vmapped], ids=["nn.scan", "nn.vmap"])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=repr)
def test_flax_scan_and_vmap_of_a_wrapped_block_train_as_plain(lift, strategy):
    x = normal(4, (5, 4, 8))
    plain, ours = lift(_Cell), lift(jaxoffload.linen.wrap(_Cell, strategy))
    variables = plain.init(jax.random.key(0), x)
    assert rel_err(ours.init(jax.random.key(0), x), variables) == 0.0

    def grad(model):
        return jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2)))(variables)

    assert rel_err(grad(ours), grad(plain)) <= 1e-6


@pytest.mark.parametrize("strategy", STRATEGIES, ids=repr)
def test_a_donated_state_is_consumed_and_updated_as_plain(strategy):
    x = normal(5, (5, 4, 8))
    plain, ours = _scanned(_Cell), _scanned(jaxoffload.linen.wrap(_Cell, strategy))
    variables = plain.init(jax.random.key(0), x)

    def sgd(model):
        def step(v, x):
            g = jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2))(v)
            return jax.tree.map(lambda p, g: p - 0.1 * g, v, g)

        return step

    ref = jax.jit(sgd(plain))(variables, x)
    donated = jax.tree.map(jnp.copy, variables)
    got = jax.jit(sgd(ours), donate_argnums=0)(donated, x)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(donated))
    assert rel_err(got, ref) <= 1e-6
