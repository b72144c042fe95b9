"""CNN layers whose backward pass needs less device memory than jax's defaults."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["max_pool", "relu", "relu_max_pool"]


@jax.custom_vjp
def relu(x: jax.Array) -> jax.Array:
    """``jax.nn.relu`` whose backward pass reads its output instead of its input.

    ``jax.nn.relu`` keeps a boolean mask of its input for the backward pass.
    The output tells the same thing (``y > 0``), and the layer that follows
    (a convolution, a pool) usually keeps the output anyway, so this rule adds
    no residual of its own. The gradient at 0 is 0, as in ``jax.nn.relu``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxoffload.layers import relu
      >>> jax.grad(lambda x: relu(x).sum())(jnp.array([-1.0, 0.0, 2.0]))
      Array([0., 0., 1.], dtype=float32)
    """
    return jnp.maximum(x, jnp.zeros((), x.dtype))


def _relu_fwd(x):
    y = relu(x)
    return y, y


def _relu_bwd(y, g):
    return (jnp.where(y > 0, g, jnp.zeros((), g.dtype)),)


relu.defvjp(_relu_fwd, _relu_bwd)


def max_pool(
    inputs: jax.Array,
    window_shape: Sequence[int],
    strides: Sequence[int] | None = None,
    padding: str = "VALID",
) -> jax.Array:
    """``flax.linen.max_pool`` with a backward pass that keeps no index tensors.

    On GPU, XLA turns the gradient of a max-pool (``select-and-scatter``) into
    a ``reduce-window`` that writes one int32 tensor per window dimension and
    an f32 copy of the pooled maxima: 1.96 GiB for VGG's first pool at batch
    128, 224x224, alive at the same time as the layer's other buffers. This
    rule recomputes the maxima from the input in the backward pass and routes
    the gradient with elementwise operations that XLA fuses into one loop.
    Ties go to the first element of the window in row-major order.

    Only non-overlapping windows (``strides == window_shape``, the default
    here is flax's, so pass them) with ``"VALID"`` padding take the lean path;
    other arguments fall back to ``flax.linen.max_pool``.

    Args:
      inputs: ``(batch, *spatial, features)``.
      window_shape: the window's spatial shape.
      strides: the strides; ``None`` means 1 in every dimension, as in flax.
      padding: ``"VALID"`` for the lean path, anything flax accepts otherwise.

    Returns:
      The pooled array, as ``flax.linen.max_pool`` returns it.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxoffload.layers import max_pool
      >>> max_pool(jnp.arange(16.0).reshape(1, 4, 4, 1), (2, 2), (2, 2))[0, :, :, 0]
      Array([[ 5.,  7.],
             [13., 15.]], dtype=float32)
    """
    window_shape = tuple(window_shape)
    strides = tuple(strides) if strides is not None else (1,) * len(window_shape)
    if not _is_lean(inputs, window_shape, strides, padding):
        return nn.max_pool(inputs, window_shape, strides=strides, padding=padding)
    return _max_pool(inputs, window_shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _max_pool(x: jax.Array, window: tuple[int, ...]) -> jax.Array:
    return functools.reduce(jnp.maximum, _window_slices(x, window))


def _max_pool_fwd(x, window):
    return _max_pool(x, window), x


def _max_pool_bwd(window, x, g):
    return (_route(g, _first_max(_window_slices(x, window)), window, x.shape),)


_max_pool.defvjp(_max_pool_fwd, _max_pool_bwd)


def relu_max_pool(
    inputs: jax.Array,
    window_shape: Sequence[int],
    strides: Sequence[int] | None = None,
    padding: str = "VALID",
) -> jax.Array:
    """``max_pool(relu(x))`` whose backward pass keeps a one-byte index, not the input.

    A ReLU followed by a max-pool needs, for its gradient, only where each
    window's maximum was and whether it was positive. This rule keeps the
    pooled output (which the next layer keeps anyway) and an int8 index per
    pooled element: for a 2x2 pool, 1/8 of the bytes of the bf16 input that
    ``max_pool`` and ``relu`` would otherwise keep. Ties go to the first
    element of the window in row-major order.

    Takes the lean path under the same conditions as :func:`max_pool`;
    otherwise it is ``max_pool(relu(inputs), ...)``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxoffload.layers import relu_max_pool
      >>> relu_max_pool(jnp.array([[-1.0, 2.0], [-3.0, -4.0]]).reshape(1, 2, 2, 1), (2, 2), (2, 2))
      Array([[[[2.]]]], dtype=float32)
    """
    window_shape = tuple(window_shape)
    strides = tuple(strides) if strides is not None else (1,) * len(window_shape)
    if not _is_lean(inputs, window_shape, strides, padding):
        return max_pool(relu(inputs), window_shape, strides, padding)
    return _relu_max_pool(inputs, window_shape, inputs.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _relu_max_pool(x: jax.Array, window: tuple[int, ...], shape: tuple[int, ...]) -> jax.Array:
    return relu(functools.reduce(jnp.maximum, _window_slices(x, window)))


def _relu_max_pool_fwd(x, window, shape):
    slices = _window_slices(x, window)
    pooled = relu(functools.reduce(jnp.maximum, slices))
    return pooled, (pooled, _first_max(slices))


def _relu_max_pool_bwd(window, shape, residuals, g):
    pooled, first = residuals
    # A window whose maximum was not positive passed no gradient through the ReLU.
    g = jnp.where(pooled > 0, g, jnp.zeros((), g.dtype))
    return (_route(g, first, window, shape),)


_relu_max_pool.defvjp(_relu_max_pool_fwd, _relu_max_pool_bwd)


def _is_lean(inputs, window_shape, strides, padding) -> bool:
    return (
        strides == window_shape
        and padding == "VALID"
        and inputs.ndim == len(window_shape) + 2
        and all(s >= w for s, w in zip(inputs.shape[1:-1], window_shape))
    )


def _first_max(slices: list[jax.Array]) -> jax.Array:
    """The position in the window of each window's first maximum, as a small integer."""
    top = functools.reduce(jnp.maximum, slices)
    first = jnp.full(top.shape, len(slices) - 1, jnp.int8 if len(slices) < 128 else jnp.int32)
    for n in reversed(range(len(slices) - 1)):
        first = jnp.where(slices[n] == top, n, first).astype(first.dtype)
    return first


def _route(g: jax.Array, first: jax.Array, window, shape) -> jax.Array:
    """Puts each window's gradient at its first maximum, zeros elsewhere.

    Interior padding places each window position's share: no scatter, and no
    index tensor of the input's size.
    """
    zero = jnp.zeros((), g.dtype)
    gx = jnp.zeros(shape, g.dtype)
    for n, offset in enumerate(itertools.product(*map(range, window))):
        gx = gx + jax.lax.pad(jnp.where(first == n, g, zero), zero, _spread(shape, window, offset))
    return gx


def _window_slices(x: jax.Array, window: tuple[int, ...]) -> list[jax.Array]:
    """One strided view of ``x`` per position in the window."""
    views = []
    for offset in itertools.product(*map(range, window)):
        index = [slice(None)]
        for size, k, o in zip(x.shape[1:-1], window, offset):
            index.append(slice(o, o + (size // k) * k, k))
        views.append(x[tuple(index + [slice(None)])])
    return views


def _spread(shape, window, offset) -> list[tuple[int, int, int]]:
    """lax.pad config that puts a pooled-size array back at ``offset`` in ``shape``."""
    config = [(0, 0, 0)]
    for size, k, o in zip(shape[1:-1], window, offset):
        pooled = size // k
        config.append((o, size - o - (pooled - 1) * k - 1, k - 1))
    return config + [(0, 0, 0)]
