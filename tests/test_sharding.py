"""Offload over a batch-sharded Mesh: same gradients, and host placement keeps the sharding.

The tests run on 4 forced CPU devices (``tests/conftest.py`` sets XLA_FLAGS).
"""

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from helpers import normal, rel_err
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxoffload

pytestmark = pytest.mark.skipif(
    jax.device_count() < 4,
    reason="needs 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=4",
)


def _mesh(axis_type):
    return jax.make_mesh((4,), ("batch",), axis_types=(axis_type,))


def _context(mesh):
    # Explicit axes are part of the types, and need the mesh in context.
    explicit = mesh.axis_types[0] == AxisType.Explicit
    return jax.set_mesh(mesh) if explicit else contextlib.nullcontext()


def _layer(w, x):
    return jnp.tanh(x @ w)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_sharded_gradients_match_unsharded(axis_type):
    mesh = _mesh(axis_type)
    w, x = normal(0, (16, 16)), normal(1, (8, 16))
    f = jaxoffload.offload(_layer, device_argnums=0)
    grad = jax.jit(jax.grad(lambda w, x: jnp.sum(f(w, x) ** 2), argnums=(0, 1)))
    reference = jax.jit(jax.grad(lambda w, x: jnp.sum(_layer(w, x) ** 2), argnums=(0, 1)))(w, x)
    with _context(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("batch")))
        got = grad(w, xs)
    assert rel_err(got, reference) <= 1e-6
    assert got[1].sharding.spec[0] == "batch"  # the input gradient stays batch-sharded


def test_host_placement_keeps_the_sharding():
    mesh = _mesh(AxisType.Explicit)
    f = jaxoffload.offload(_layer, device_argnums=0)
    with _context(mesh):
        w = normal(0, (16, 16))
        xs = jax.device_put(normal(1, (8, 16)), NamedSharding(mesh, P("batch")))
        jaxpr = jax.make_jaxpr(jax.grad(lambda w, x: f(w, x).sum(), argnums=(0, 1)))(w, xs)
    to_host = [
        eqn
        for eqn in jaxpr.jaxpr.eqns
        if eqn.primitive.name == "device_put" and jax.memory.Space.Host in eqn.params["devices"]
    ]
    assert to_host
    for eqn in to_host:
        aval = eqn.outvars[0].aval
        assert aval.sharding.spec == P("batch", None), aval  # batch-sharded on the host too
        assert aval.memory_space == jax.memory.Space.Host


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        block = jaxoffload.linen.offload(nn.Conv)
        x = nn.relu(block(8, (3, 3))(x))
        x = nn.relu(block(8, (3, 3))(x))
        return nn.Dense(4)(x.mean((1, 2)))


def test_sharded_flax_training_step():
    mesh = _mesh(AxisType.Auto)
    x = normal(0, (8, 6, 6, 3))
    params = Net().init(jax.random.key(0), x)["params"]
    loss = lambda p, x: jnp.sum(Net().apply({"params": p}, x) ** 2)  # noqa: E731
    grad = jax.jit(jax.grad(loss))
    got = grad(params, jax.device_put(x, NamedSharding(mesh, P("batch"))))
    assert rel_err(got, grad(params, x)) <= 1e-6
