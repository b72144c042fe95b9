"""CNN layers whose backward pass needs less device memory than jax's defaults."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxoffload._src import pool_kernel

__all__ = ["Pool", "first_max", "max_pool", "relu", "relu_max_pool"]


@jax.custom_vjp
def relu(x: jax.Array) -> jax.Array:
    """``jax.nn.relu`` whose backward pass reads its output instead of its input.

    ``jax.nn.relu`` keeps a boolean mask of its input for the backward pass.
    The output tells the same thing (``y > 0``), and the layer that follows
    (a convolution, a pool) usually keeps the output anyway, so this rule adds
    no residual of its own. The gradient at 0 is 0, as in ``jax.nn.relu``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxoffload._src.layers import relu
      >>> jax.grad(lambda x: relu(x).sum())(jnp.array([-1.0, 0.0, 2.0]))
      Array([0., 0., 1.], dtype=float32)
    """
    return _positive(x)


def _positive(x):
    """``max(x, 0)`` in ``x``'s dtype: the ReLU, without a rule of its own."""
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
    padding: str | Sequence[tuple[int, int]] = "VALID",
) -> jax.Array:
    """``flax.linen.max_pool`` with a backward pass that keeps no index tensors.

    On GPU, XLA turns the gradient of a max-pool (``select-and-scatter``) into
    a ``reduce-window`` that writes one int32 tensor per window dimension and
    an f32 copy of the pooled maxima, as large as the pool's input, alive at
    the same time as the layer's other buffers. This
    rule recomputes the maxima from the input in the backward pass and routes
    the gradient with elementwise operations that XLA fuses into one loop.
    Ties go to the first element of the window in row-major order.

    Windows may overlap (``strides`` smaller than the window, as in ResNet's
    3x3, stride-2 stem pool), and padding counts as ``-inf``, as in flax.
    Arguments that flax accepts but this rule does not (an input without a
    batch dimension, an integer dtype, a window that lies wholly in the
    padding) fall back to ``flax.linen.max_pool``.

    Args:
      inputs: ``(batch, *spatial, features)``.
      window_shape: the window's spatial shape.
      strides: the strides; ``None`` means 1 in every dimension, as in flax.
      padding: ``"VALID"``, ``"SAME"``, or one ``(low, high)`` pair per
        spatial dimension.

    Returns:
      The pooled array, as ``flax.linen.max_pool`` returns it.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxoffload._src.layers import max_pool
      >>> max_pool(jnp.arange(16.0).reshape(1, 4, 4, 1), (2, 2), (2, 2))[0, :, :, 0]
      Array([[ 5.,  7.],
             [13., 15.]], dtype=float32)
    """
    pool = Pool.of(inputs, window_shape, strides, padding)
    if pool is None:
        return nn.max_pool(inputs, tuple(window_shape), strides=strides, padding=padding)
    return _max_pool(inputs, pool)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _max_pool(x: jax.Array, pool: Pool) -> jax.Array:
    return functools.reduce(jnp.maximum, pool.slices(x))


def _max_pool_fwd(x, pool):
    return _max_pool(x, pool), x


def _max_pool_bwd(pool, x, g):
    return (pool.route(g, first_max(pool.slices(x)), x.shape),)


_max_pool.defvjp(_max_pool_fwd, _max_pool_bwd)


def relu_max_pool(
    inputs: jax.Array,
    window_shape: Sequence[int],
    strides: Sequence[int] | None = None,
    padding: str | Sequence[tuple[int, int]] = "VALID",
) -> jax.Array:
    """``max_pool(relu(x))`` whose backward pass keeps a one-byte index, not the input.

    A ReLU followed by a max-pool needs, for its gradient, only where each
    window's maximum was and whether it was positive. This rule keeps the
    pooled output (which the next layer keeps anyway) and an int8 index per
    pooled element: for a 2x2 pool, 1/8 of the bytes of the bf16 input that
    ``max_pool`` and ``relu`` would otherwise keep. Ties go to the first
    element of the window in row-major order.

    Takes the same arguments as :func:`max_pool`, and falls back under the
    same conditions, to ``max_pool(relu(inputs), ...)``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxoffload._src.layers import relu_max_pool
      >>> relu_max_pool(jnp.array([[-1.0, 2.0], [-3.0, -4.0]]).reshape(1, 2, 2, 1), (2, 2), (2, 2))
      Array([[[[2.]]]], dtype=float32)
    """
    pool = Pool.of(inputs, window_shape, strides, padding)
    if pool is None:
        return max_pool(relu(inputs), window_shape, strides, padding)
    return _relu_max_pool(inputs, pool, inputs.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _relu_max_pool(x: jax.Array, pool: Pool, shape: tuple[int, ...]) -> jax.Array:
    return relu(functools.reduce(jnp.maximum, pool.slices(x)))


def _relu_max_pool_fwd(x, pool, shape):
    slices = pool.slices(x)
    pooled = relu(functools.reduce(jnp.maximum, slices))
    return pooled, (pooled, first_max(slices))


def _relu_max_pool_bwd(pool, shape, residuals, g):
    pooled, first = residuals
    # A window whose maximum was not positive passed no gradient through the ReLU.
    g = jnp.where(pooled > 0, g, jnp.zeros((), g.dtype))
    return (pool.route(g, first, shape),)


_relu_max_pool.defvjp(_relu_max_pool_fwd, _relu_max_pool_bwd)


def first_max(slices: list[jax.Array]) -> jax.Array:
    """The position in the window of each window's first maximum, as a small integer."""
    top = functools.reduce(jnp.maximum, slices)
    first = jnp.full(top.shape, len(slices) - 1, jnp.int8 if len(slices) < 128 else jnp.int32)
    for n in reversed(range(len(slices) - 1)):
        first = jnp.where(slices[n] == top, n, first).astype(first.dtype)
    return first


@dataclasses.dataclass(frozen=True)
class Pool:
    """A pool's static geometry: window, strides and ``(low, high)`` padding per spatial dimension."""

    window: tuple[int, ...]
    strides: tuple[int, ...]
    pads: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, inputs, window_shape, strides, padding) -> Pool | None:
        """The geometry, or ``None`` where the lean rules do not apply (see :func:`max_pool`)."""
        window = tuple(int(k) for k in window_shape)
        strides = tuple(int(s) for s in strides) if strides is not None else (1,) * len(window)
        spatial = inputs.shape[1:-1]
        if inputs.ndim != len(window) + 2 or not jnp.issubdtype(inputs.dtype, jnp.floating):
            return None
        if isinstance(padding, str):
            pads = jax.lax.padtype_to_pads(spatial, window, strides, padding)
        else:
            pads = padding
        pads = tuple((int(lo), int(hi)) for lo, hi in pads)
        if len(pads) != len(window) or any(
            lo >= k or hi >= k or n + lo + hi < k for (lo, hi), k, n in zip(pads, window, spatial)
        ):
            return None
        return cls(window, strides, pads)

    def slices(self, x: jax.Array) -> list[jax.Array]:
        """One strided view of ``x``, padded with ``-inf``, per position in the window."""
        if any(lo or hi for lo, hi in self.pads):
            x = jnp.pad(x, [(0, 0), *self.pads, (0, 0)], constant_values=-jnp.inf)
        views = []
        for offset in itertools.product(*map(range, self.window)):
            index = [slice(None)]
            for size, k, s, o in zip(x.shape[1:-1], self.window, self.strides, offset):
                index.append(slice(o, o + (size - k) // s * s + 1, s))
            views.append(x[tuple(index + [slice(None)])])
        return views

    def route(self, g: jax.Array, first: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        """Puts each window's gradient at its first maximum of an input of ``shape``.

        No scatter, and no index tensor of the input's size. Windows that do
        not overlap are placed by interior padding, one share per window
        position; overlapping ones by phases (:meth:`route_by_phases`),
        or, for a 3x3, stride-2 pool on a CUDA GPU, by a Pallas kernel that
        gives the same values (:mod:`jaxoffload._src.pool_kernel`). Each way
        is used where it measured the fastest, or kept the least memory
        (``docs/design.md``).
        """
        if all(s >= k for k, s in zip(self.window, self.strides)):
            return self.route_by_padding(g, first, shape)
        if pool_kernel.applies(self.window, self.strides, self.pads, shape, g.dtype):
            # CUDA GPUs run the kernel; other backends compile the phases.
            return jax.lax.platform_dependent(
                g,
                first,
                cuda=functools.partial(pool_kernel.route, shape=shape),
                default=lambda g, first: self.route_by_phases(g, first, shape),
            )
        return self.route_by_phases(g, first, shape)

    def route_by_padding(self, g, first, shape):
        """:meth:`route` for windows that do not overlap: each position's share, padded in."""
        padded = self._padded(shape)
        zero = jnp.zeros((), g.dtype)
        gx = jnp.zeros((shape[0], *padded, shape[-1]), g.dtype)
        for n, offset in enumerate(itertools.product(*map(range, self.window))):
            config = [(0, 0, 0)]
            for size, k, s, o in zip(padded, self.window, self.strides, offset):
                config.append((o, size - o - (size - k) // s * s - 1, s - 1))
            gx = gx + jax.lax.pad(jnp.where(first == n, g, zero), zero, config + [(0, 0, 0)])
        return self._unpad(gx, shape)

    def _padded(self, shape) -> list[int]:
        """The padded input's spatial sizes."""
        return [n + lo + hi for n, (lo, hi) in zip(shape[1:-1], self.pads)]

    def _unpad(self, gx, shape):
        index = [slice(lo, lo + n) for n, (lo, _) in zip(shape[1:-1], self.pads)]
        return gx[(slice(None), *index, slice(None))]

    def route_by_phases(self, g, first, shape):
        """Interleaves the phases (:meth:`_phases`) into the input's gradient."""
        phases, sizes = self._phases(g, first, shape)
        # (batch, q1, ..., channels) per phase -> (batch, q1, r1, q2, r2, ..., channels).
        d = len(self.strides)
        gx = jnp.stack(list(phases.values()), axis=-2).reshape(
            g.shape[0], *sizes, *self.strides, g.shape[-1]
        )
        order = [0, *(a for i in range(d) for a in (1 + i, 1 + d + i)), 1 + 2 * d]
        gx = gx.transpose(order)
        # One (q, r) pair merged per reshape: a batch-sharded array under an Explicit mesh
        # reshapes only when one axis is merged at a time (tests/test_sharding.py).
        for i, (q, s) in enumerate(zip(sizes, self.strides)):
            gx = gx.reshape(*gx.shape[: 1 + i], q * s, *gx.shape[3 + i :])
        return self._unpad(gx, shape)

    def _phases(self, g, first, shape):
        """``({residues: phase}, phase sizes)``: the input's gradient, split by position mod stride.

        Input position ``q * stride + r`` (per spatial dimension, padded) can
        only be window position ``r + t * stride`` of window ``q - t``: each
        residue ``r`` (phase) is a sum of a few shifted copies of ``g``,
        ``ceil(padded size / stride)`` long. Each input element reads
        only the windows that can cover it. Phases come in row-major order of
        their residues.
        """
        per_dim = list(zip(self._padded(shape), self.window, self.strides, g.shape[1:-1]))
        sizes = [-(-size // s) for size, _, s, _ in per_dim]
        zero = jnp.zeros((), g.dtype)
        phases = {}
        for residues in itertools.product(*(range(s) for s in self.strides)):
            phase = jnp.zeros((g.shape[0], *sizes, g.shape[-1]), g.dtype)
            shifts = [range(-(-(k - r) // s)) for r, (_, k, s, _) in zip(residues, per_dim)]
            for ts in itertools.product(*shifts):
                offset = [r + t * s for r, t, s in zip(residues, ts, self.strides)]
                n = int(np.ravel_multi_index(offset, self.window))
                share = jnp.where(first == n, g, zero)
                # share[q - t] at q: shift right by t, and cut or fill to the phase's size.
                config = [(0, 0, 0)]
                config += [(t, q - j - t, 0) for t, q, (_, _, _, j) in zip(ts, sizes, per_dim)]
                phase = phase + jax.lax.pad(share, zero, config + [(0, 0, 0)])
            phases[residues] = phase
        return phases, sizes
