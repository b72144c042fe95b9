"""On a GPU, offloaded residuals really leave the device (run through the device tool)."""

import functools

import jax
import jax.numpy as jnp
import pytest

import jaxoffload

pytestmark = pytest.mark.gpu

BATCH, N, LAYERS = 16384, 4096, 8


def _chain(layer, window=None):
    """grad of a chain of layers with one weight matrix each, under jit.

    ``layer`` is a function, or with ``window`` a function of the window that makes one.
    """
    if window is not None:
        layer = layer(window)

    def loss(ws, x):
        for w in ws:
            x = layer(w, x)
        return x.sum()

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def _offloaded(window=1):
    return jaxoffload.offload(_tanh, device_argnums=0, window=window)


def _tanh(w, x):
    return jnp.tanh(x @ w)


def _inputs():
    k1, k2 = jax.random.split(jax.random.key(0))
    ws = [w / N**0.5 for w in jax.random.normal(k1, (LAYERS, N, N), jnp.float32)]
    return ws, jax.random.normal(k2, (BATCH, N), jnp.float32)


@functools.partial(jax.custom_vjp)
def _naive(w, x):
    return _tanh(w, x)


def _naive_fwd(w, x):
    return _tanh(w, x), (w, jax.device_put(x, jax.memory.Space.Host))


def _naive_bwd(res, g):
    w, x = res
    x = jax.device_put(x, jax.memory.Space.Device)
    y = _tanh(w, x)
    gy = g * (1 - y * y)
    return x.T @ gy, gy @ w.T


_naive.defvjp(_naive_fwd, _naive_bwd)


@pytest.fixture(scope="module")
def args():
    return _inputs()


def test_offload_moves_residuals_and_lowers_device_temp(args):
    plain = jaxoffload.memory_report(_chain(_tanh), *args)
    off = jaxoffload.memory_report(
        _chain(jaxoffload.offload(_tanh, device_argnums=0)), *args, on_dropped="raise"
    )
    per_layer = BATCH * N * 4  # at least each layer's input moves
    assert off.moved and off.host_to_device >= LAYERS
    assert off.device_to_host_bytes >= LAYERS * per_layer
    assert off.host_temp_bytes >= LAYERS * per_layer
    assert off.temp_bytes < plain.temp_bytes / 2, (off.temp_bytes, plain.temp_bytes)


def test_offload_gradients_match_on_gpu(args):
    ref = _chain(_tanh)(*args)
    got = _chain(jaxoffload.offload(_tanh, device_argnums=0))(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        # Same operations in the same order; 1e-3 leaves room for TF32 fusions.
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) <= 1e-3


def test_scheduled_offload_keeps_copies_and_gradients(args):
    one = jaxoffload.memory_report(_chain(_offloaded()), *args, on_dropped="raise")
    two = jaxoffload.memory_report(_chain(_offloaded, window=2), *args, on_dropped="raise")
    assert two.device_to_host_bytes == one.device_to_host_bytes >= LAYERS * BATCH * N * 4
    assert two.host_to_device_bytes == one.host_to_device_bytes
    ref = _chain(_tanh)(*args)
    got = _chain(_offloaded, window=2)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) <= 1e-3


def test_scheduled_offload_bounds_device_temp(args):
    # Each step of the window may hold one more layer's residuals (its input and
    # output) on the device, and depth adds nothing.
    ws, x = args
    per_layer, slack = 2 * BATCH * N * 4, 1 << 20  # slack: the scalar tokens
    temp = {w: jaxoffload.memory_report(_chain(_offloaded, w), *args).temp_bytes for w in (1, 2, 3)}
    for w in (2, 3):
        assert temp[w] <= temp[1] + (w - 1) * per_layer + slack, temp
    deeper = jaxoffload.memory_report(_chain(_offloaded, 2), ws + ws, x).temp_bytes
    assert deeper <= temp[2] + slack, (deeper, temp)


def test_dropped_offload_is_reported(args):
    # A bare device_put pair in a custom_vjp is deleted by XLA:GPU (docs/design.md).
    with pytest.raises(jaxoffload.OffloadDroppedError):
        jaxoffload.memory_report(_chain(_naive), *args, on_dropped="raise")
    with pytest.warns(jaxoffload.OffloadWarning):
        report = jaxoffload.memory_report(_chain(_naive), *args)
    assert report.requested and not report.moved and report.dropped


def test_runtime_peak_falls():
    # Each variant runs in a fresh process: peak_bytes_in_use never goes down.
    import os
    import subprocess
    import sys

    code = """
import jax, jaxoffload, sys
sys.path.insert(0, "tests")
from test_gpu import _chain, _inputs, _tanh
layer = jaxoffload.offload(_tanh, device_argnums=0) if sys.argv[1] == "offload" else _tanh
jax.block_until_ready(_chain(layer)(*_inputs()))
print(jax.devices()[0].memory_stats()["peak_bytes_in_use"])
"""
    # The test process already holds most of the GPU: give each child a slice.
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION="0.15")
    peaks = {
        mode: int(
            subprocess.check_output([sys.executable, "-c", code, mode], text=True, env=env).split()[
                -1
            ]
        )
        for mode in ("plain", "offload")
    }
    # Arguments and outputs (weights, gradients) stay; the residuals leave.
    assert peaks["offload"] < 0.7 * peaks["plain"], peaks


def test_stem_pool_gradient_comes_from_the_kernel_with_the_xla_routes_values():
    from jaxoffload._src.layers import Pool, first_max, relu_max_pool

    shape = (32, 112, 112, 64)
    geometry = (3, 3), (2, 2), ((1, 1), (1, 1))
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, shape, jnp.bfloat16)
    w = jax.random.normal(kw, (32, 56, 56, 64), jnp.bfloat16)  # sums of up to 4 round

    def loss(x):
        return (relu_max_pool(x, *geometry) * w).astype(jnp.float32).sum()

    grad = jax.jit(jax.grad(loss))
    assert "__gpu$xla.gpu.triton" in grad.lower(x).compile().as_text()

    def by_phases(x):
        pool = Pool.of(x, *geometry)
        g = jnp.where(relu_max_pool(x, *geometry) > 0, w, jnp.zeros((), w.dtype))
        return pool.route_by_phases(g, first_max(pool.slices(x)), shape)

    assert jnp.array_equal(grad(x), jax.jit(by_phases)(x))


def test_nnx_offload_moves_a_plain_nnx_models_residuals():
    from flax import nnx

    from jaxoffload.bench import models
    from jaxoffload.bench.models import flax_nnx_resnet

    def report(strategy):
        model = flax_nnx_resnet.ResNet(
            (2, 2), flax_nnx_resnet.BottleneckResNetBlock, num_classes=10, rngs=nnx.Rngs(0)
        )
        models.wrap_nnx_blocks(model, strategy)
        graphdef, state = nnx.split(model)

        def gradient(state, x):
            return nnx.grad(lambda m: m(x).sum())(nnx.merge(graphdef, state))

        x = jnp.ones((128, 64, 64, 3))
        return jaxoffload.memory_report(jax.jit(gradient), state, x, on_dropped="raise")

    plain, off = report(jaxoffload.Store()), report(jaxoffload.Offload())
    assert off.moved and off.device_to_host_bytes > 0 and off.host_temp_bytes > 0
    assert off.temp_bytes < 0.7 * plain.temp_bytes, (off.temp_bytes, plain.temp_bytes)


def test_a_trace_sees_the_copies_that_the_program_makes():
    # Each layer moves what its backward pass needs: 256 MiB activations, each way.
    ws, x = _inputs()
    step = jax.jit(_chain(_offloaded(window=2)), compiler_options=jaxoffload.compiler_options())
    overlap = jaxoffload.measure_overlap(lambda: step(ws, x), steps=3, warmup=1)
    moved = sum(c.host_bytes for c in jaxoffload.offloaded_calls(_chain(_offloaded(2)), ws, x))
    assert overlap.device.startswith("/device:GPU") and overlap.steps == 3
    assert overlap.d2h_bytes == overlap.h2d_bytes == moved > 0
    # The link moves them at tens of GB/s, and a share of them runs under compute.
    assert 10 < overlap.d2h_bytes / overlap.d2h_busy_ms / 1e6 < 100
    assert 0 <= overlap.d2h_overlap_fraction <= 1 and 0 <= overlap.h2d_overlap_fraction <= 1
    assert overlap.compute_busy_ms > 0
