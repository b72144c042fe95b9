"""CNN layers whose backward pass needs less device memory than jax's defaults."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = [
    "BatchNorm",
    "batch_norm",
    "batch_norm_add",
    "batch_norm_relu_conv",
    "conv_after",
    "max_pool",
    "relu",
    "relu_conv",
    "relu_max_pool",
]


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
    an f32 copy of the pooled maxima: 1.96 GiB for VGG's first pool at batch
    128, 224x224, alive at the same time as the layer's other buffers. This
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
      >>> from jaxoffload.layers import max_pool
      >>> max_pool(jnp.arange(16.0).reshape(1, 4, 4, 1), (2, 2), (2, 2))[0, :, :, 0]
      Array([[ 5.,  7.],
             [13., 15.]], dtype=float32)
    """
    pool = _Pool.of(inputs, window_shape, strides, padding)
    if pool is None:
        return nn.max_pool(inputs, tuple(window_shape), strides=strides, padding=padding)
    return _max_pool(inputs, pool)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _max_pool(x: jax.Array, pool: _Pool) -> jax.Array:
    return functools.reduce(jnp.maximum, pool.slices(x))


def _max_pool_fwd(x, pool):
    return _max_pool(x, pool), x


def _max_pool_bwd(pool, x, g):
    return (pool.route(g, _first_max(pool.slices(x)), x.shape),)


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
      >>> from jaxoffload.layers import relu_max_pool
      >>> relu_max_pool(jnp.array([[-1.0, 2.0], [-3.0, -4.0]]).reshape(1, 2, 2, 1), (2, 2), (2, 2))
      Array([[[[2.]]]], dtype=float32)
    """
    pool = _Pool.of(inputs, window_shape, strides, padding)
    if pool is None:
        return max_pool(relu(inputs), window_shape, strides, padding)
    return _relu_max_pool(inputs, pool, inputs.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _relu_max_pool(x: jax.Array, pool: _Pool, shape: tuple[int, ...]) -> jax.Array:
    return relu(functools.reduce(jnp.maximum, pool.slices(x)))


def _relu_max_pool_fwd(x, pool, shape):
    slices = pool.slices(x)
    pooled = relu(functools.reduce(jnp.maximum, slices))
    return pooled, (pooled, _first_max(slices))


def _relu_max_pool_bwd(pool, shape, residuals, g):
    pooled, first = residuals
    # A window whose maximum was not positive passed no gradient through the ReLU.
    g = jnp.where(pooled > 0, g, jnp.zeros((), g.dtype))
    return (pool.route(g, first, shape),)


_relu_max_pool.defvjp(_relu_max_pool_fwd, _relu_max_pool_bwd)


def _first_max(slices: list[jax.Array]) -> jax.Array:
    """The position in the window of each window's first maximum, as a small integer."""
    top = functools.reduce(jnp.maximum, slices)
    first = jnp.full(top.shape, len(slices) - 1, jnp.int8 if len(slices) < 128 else jnp.int32)
    for n in reversed(range(len(slices) - 1)):
        first = jnp.where(slices[n] == top, n, first).astype(first.dtype)
    return first


@dataclasses.dataclass(frozen=True)
class _Pool:
    """A pool's static geometry: window, strides and ``(low, high)`` padding per spatial dimension."""

    window: tuple[int, ...]
    strides: tuple[int, ...]
    pads: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, inputs, window_shape, strides, padding) -> _Pool | None:
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

        Interior padding places each window position's share, and overlapping
        windows add theirs: no scatter, and no index tensor of the input's size.
        """
        padded = [n + lo + hi for n, (lo, hi) in zip(shape[1:-1], self.pads)]
        zero = jnp.zeros((), g.dtype)
        gx = jnp.zeros((shape[0], *padded, shape[-1]), g.dtype)
        for n, offset in enumerate(itertools.product(*map(range, self.window))):
            config = [(0, 0, 0)]
            for size, k, s, o in zip(padded, self.window, self.strides, offset):
                config.append((o, size - o - (size - k) // s * s - 1, s - 1))
            gx = gx + jax.lax.pad(jnp.where(first == n, g, zero), zero, config + [(0, 0, 0)])
        index = [slice(lo, lo + n) for n, (lo, _) in zip(shape[1:-1], self.pads)]
        return gx[(slice(None), *index, slice(None))]


def batch_norm(
    x: jax.Array,
    scale: jax.Array,
    bias: jax.Array,
    *,
    epsilon: float = 1e-5,
    relu: bool = False,
    dtype: Any = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Training-mode batch normalisation over all axes but the last, optionally fused with a ReLU.

    Differentiating ``flax.linen.BatchNorm`` keeps several float32 copies of
    its input (centred, normalised) even when the input is bf16, and a ReLU
    after it keeps a mask. This rule keeps only its input, in the input's
    dtype, and the per-channel mean and inverse standard deviation; the
    backward pass recomputes the normalised values and the ReLU mask, which
    is elementwise work that XLA fuses into the reductions it needs anyway.

    The statistics are flax's: float32, ``var = mean(x²) - mean(x)²``
    clipped at 0 (``use_fast_variance=True``).

    Args:
      x: ``(..., features)``.
      scale: ``(features,)``.
      bias: ``(features,)``.
      epsilon: added to the variance.
      relu: apply ``max(y, 0)`` to the output.
      dtype: the output's dtype; ``None`` means ``x``'s.

    Returns:
      ``(y, mean, var)``: the output, and the float32 batch statistics (for
      running averages).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxoffload.layers import batch_norm
      >>> y, mean, var = batch_norm(jnp.array([[1.0], [3.0]]), jnp.ones(1), jnp.zeros(1))
      >>> y[:, 0], mean, var
      (Array([-0.999995,  0.999995], dtype=float32), Array([2.], dtype=float32), Array([1.], dtype=float32))
    """
    dtype = jnp.dtype(x.dtype if dtype is None else dtype)
    return _batch_norm(x, scale, bias, epsilon, relu, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _batch_norm(x, scale, bias, epsilon, relu, dtype):
    y, mean, var, _ = _batch_norm_forward(x, scale, bias, epsilon, relu, dtype)
    return y, mean, var


def _batch_norm_forward(x, scale, bias, epsilon, relu, dtype):
    axes = tuple(range(x.ndim - 1))
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    mean = x32.mean(axes)
    var = jnp.maximum(0.0, (x32 * x32).mean(axes) - mean * mean)
    inv_std = jax.lax.rsqrt(var + epsilon)
    y = _normalised(x, mean, inv_std, scale, bias, relu)
    return y.astype(dtype), mean, var, inv_std


def _normalised(x, mean, inv_std, scale, bias, relu):
    """The float32 output; one expression, so that recomputed values and masks match bit for bit."""
    y = (x.astype(mean.dtype) - mean) * (inv_std * scale) + bias
    return jnp.maximum(y, 0.0) if relu else y


def _batch_norm_fwd(x, scale, bias, epsilon, relu, dtype):
    y, mean, var, inv_std = _batch_norm_forward(x, scale, bias, epsilon, relu, dtype)
    return (y, mean, var), (x, mean, inv_std, scale, bias)


def _batch_norm_bwd(epsilon, relu, dtype, residuals, cotangents):
    x, mean, inv_std, scale, bias = residuals
    g, g_mean, g_var = cotangents
    # Recomputed here, after the cotangent: not merged with the forward pass's values.
    (x, mean, inv_std), g = jax.lax.optimization_barrier(((x, mean, inv_std), g))
    return _batch_norm_grads(x, mean, inv_std, scale, bias, relu, g, g_mean, g_var)


def _batch_norm_grads(x, mean, inv_std, scale, bias, relu, g, g_mean, g_var):
    """``(g_x, g_scale, g_bias)`` of :func:`batch_norm`, from its input ``x``."""
    normalised = (x.astype(mean.dtype) - mean) * inv_std
    g = g.astype(mean.dtype)
    if relu:
        g = jnp.where(_normalised(x, mean, inv_std, scale, bias, relu=False) > 0, g, 0.0)
    g_x, g_scale, g_bias = _normalised_grads(normalised, inv_std, scale, g, g_mean, g_var)
    return g_x.astype(x.dtype), g_scale.astype(scale.dtype), g_bias.astype(bias.dtype)


def _normalised_grads(normalised, inv_std, scale, g, g_mean, g_var):
    """The float32 gradients of batch normalisation, from its normalised values (not its input)."""
    axes = tuple(range(g.ndim - 1))
    count = g.size // g.shape[-1]
    g_bias = g.sum(axes)
    g_scale = (g * normalised).sum(axes)
    g_x = (scale * inv_std) * (g - (g_bias + normalised * g_scale) / count)
    # The statistics are outputs too; their cotangents are zero in a loss,
    # but a user may differentiate them.
    g_x = g_x + (g_mean + 2.0 * g_var * (normalised / inv_std)) / count
    return g_x, g_scale, g_bias


_batch_norm.defvjp(_batch_norm_fwd, _batch_norm_bwd)


def batch_norm_relu_conv(
    x: jax.Array,
    scale: jax.Array,
    bias: jax.Array,
    kernel: jax.Array,
    *,
    epsilon: float = 1e-5,
    dtype: Any = None,
    **conv_kwargs: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A convolution of ``relu(batch_norm(x))`` that keeps ``x`` but not the convolution's input.

    A convolution keeps its input for the kernel's gradient. Here that input
    is elementwise work on ``x``, which the BatchNorm keeps anyway, so this
    rule keeps ``x``, the kernel and the per-channel statistics, and the
    backward pass recomputes the convolution's input. In a ResNet bottleneck
    that drops two of the branch's six stored tensors (of sizes 4:1:1:1:1:4,
    in units of the narrow width); no convolution is recomputed.

    Args:
      x: ``(..., features)``, as in :func:`batch_norm`.
      scale, bias, epsilon, dtype: as in :func:`batch_norm` with ``relu=True``.
      kernel: the convolution's kernel.
      **conv_kwargs: the other arguments of ``jax.lax.conv_general_dilated``
        (``window_strides``, ``padding``, ``dimension_numbers``, ...).

    Returns:
      ``(y, mean, var)``: the convolution's output, and the float32 batch
      statistics, as :func:`batch_norm` gives them.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxoffload.layers import batch_norm_relu_conv
      >>> x, kernel = jnp.arange(8.0).reshape(1, 2, 2, 2), jnp.ones((1, 1, 2, 3))
      >>> y, mean, var = batch_norm_relu_conv(x, jnp.ones(2), jnp.zeros(2), kernel,
      ...     window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
      >>> y.shape, mean
      ((1, 2, 2, 3), Array([3., 4.], dtype=float32))
    """
    dtype = jnp.dtype(x.dtype if dtype is None else dtype)
    return _batch_norm_relu_conv(x, scale, bias, kernel, epsilon, dtype, _conv_spec(conv_kwargs))


def _conv_spec(conv_kwargs: dict) -> tuple:
    """``conv_general_dilated``'s keyword arguments as a static, hashable argument."""
    return tuple(sorted((k, _hashable(v)) for k, v in conv_kwargs.items()))


def _hashable(value):
    """Lists (such as padding) as tuples, so that they can be static arguments."""
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return tuple(_hashable(v) for v in value)
    return value


def _convolve(a, kernel, conv):
    return jax.lax.conv_general_dilated(a, kernel, **dict(conv))


def _convolve_grads(a, kernel, conv, g_y):
    """``(g_a, g_kernel)`` of :func:`_convolve` at the recomputed input ``a``."""
    _, convolve_vjp = jax.vjp(lambda a, kernel: _convolve(a, kernel, conv), a, kernel)
    return convolve_vjp(g_y)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _batch_norm_relu_conv(x, scale, bias, kernel, epsilon, dtype, conv):
    a, mean, var, _ = _batch_norm_forward(x, scale, bias, epsilon, True, dtype)
    return _convolve(a, kernel, conv), mean, var


def _batch_norm_relu_conv_fwd(x, scale, bias, kernel, epsilon, dtype, conv):
    a, mean, var, inv_std = _batch_norm_forward(x, scale, bias, epsilon, True, dtype)
    return (_convolve(a, kernel, conv), mean, var), (x, mean, inv_std, scale, bias, kernel)


def _batch_norm_relu_conv_bwd(epsilon, dtype, conv, residuals, cotangents):
    x, mean, inv_std, scale, bias, kernel = residuals
    g_y, g_mean, g_var = cotangents
    # Through a barrier with the cotangent, as jax.checkpoint does: otherwise
    # XLA merges the recomputation with the forward pass's, and keeps the
    # convolution's input alive until now after all.
    (x, mean, inv_std), g_y = jax.lax.optimization_barrier(((x, mean, inv_std), g_y))
    a = _normalised(x, mean, inv_std, scale, bias, relu=True).astype(dtype)
    g_a, g_kernel = _convolve_grads(a, kernel, conv, g_y)
    return (*_batch_norm_grads(x, mean, inv_std, scale, bias, True, g_a, g_mean, g_var), g_kernel)


_batch_norm_relu_conv.defvjp(_batch_norm_relu_conv_fwd, _batch_norm_relu_conv_bwd)


def relu_conv(
    lhs: jax.Array, rhs: jax.Array, window_strides: Sequence[int], padding: Any, **conv_kwargs: Any
) -> jax.Array:
    """``jax.lax.conv_general_dilated(relu(lhs), rhs, ...)`` that keeps ``lhs``, not ``relu(lhs)``.

    The same size either way, but ``lhs`` may be kept anyway: in a ResNet
    whose blocks end before their ReLU, it is the previous block's output,
    which that block's :func:`batch_norm_add` keeps. The backward pass
    recomputes ``relu(lhs)``. Takes the arguments of
    ``jax.lax.conv_general_dilated``, so it can be given to
    ``flax.linen.Conv(conv_general_dilated=relu_conv)``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxoffload.layers import relu_conv
      >>> x = jnp.array([-1.0, 2.0]).reshape(1, 1, 2, 1)
      >>> relu_conv(x, jnp.ones((1, 2, 1, 1)), (1, 1), "VALID",
      ...           dimension_numbers=("NHWC", "HWIO", "NHWC"))[0, 0, 0, 0]
      Array(2., dtype=float32)
    """
    conv = dict(window_strides=window_strides, padding=padding, **conv_kwargs)
    return _relu_conv(lhs, rhs, _conv_spec(conv))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _relu_conv(x, kernel, conv):
    return _convolve(_positive(x), kernel, conv)


def _relu_conv_fwd(x, kernel, conv):
    return _relu_conv(x, kernel, conv), (x, kernel)


def _relu_conv_bwd(conv, residuals, g_y):
    x, kernel = residuals
    (x,), g_y = jax.lax.optimization_barrier(((x,), g_y))  # see _batch_norm_relu_conv_bwd
    g_a, g_kernel = _convolve_grads(_positive(x), kernel, conv, g_y)
    return jnp.where(x > 0, g_a, jnp.zeros((), g_a.dtype)), g_kernel


_relu_conv.defvjp(_relu_conv_fwd, _relu_conv_bwd)


def batch_norm_add(
    x: jax.Array,
    shortcut: jax.Array,
    scale: jax.Array,
    bias: jax.Array,
    *,
    epsilon: float = 1e-5,
    relu_shortcut: bool = False,
    shortcut_scale: jax.Array | None = None,
    shortcut_bias: jax.Array | None = None,
    dtype: Any = None,
) -> tuple[jax.Array, ...]:
    """``batch_norm(x) + s`` that keeps the sum and the shortcut, not ``x``.

    The end of a ResNet block. ``s`` is ``shortcut``, ``relu(shortcut)`` if
    ``relu_shortcut``, or, given ``shortcut_scale`` and ``shortcut_bias``,
    ``batch_norm(shortcut)`` with its own batch statistics (a block whose
    shortcut is a convolution). The sum is the next block's input, which
    that block keeps anyway, and the shortcut is this block's input or the
    shortcut convolution's output, which is kept anyway too. The backward
    pass recomputes ``s`` and inverts the normalisation, in the style of
    in-place activated BatchNorm (Rota Bulò et al., 2018):
    ``normalised = (sum - s - bias) / scale``. That drops one full-size
    residual per block.

    The inversion divides by ``scale``: channels whose ``scale`` is near zero
    get inaccurate gradients (exactly zero gives inf or NaN). Do not use it
    with BatchNorms initialised at ``scale = 0`` ("zero-init residual").

    Args:
      x: ``(..., features)``, as in :func:`batch_norm`.
      shortcut: the array added, of the output's shape.
      scale, bias, epsilon, dtype: as in :func:`batch_norm`.
      relu_shortcut: add ``relu(shortcut)``.
      shortcut_scale, shortcut_bias: normalise the shortcut with these.

    Returns:
      ``(y, mean, var)``: the sum, and the float32 batch statistics of ``x``;
      with a normalised shortcut, its statistics follow:
      ``(y, mean, var, shortcut_mean, shortcut_var)``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxoffload.layers import batch_norm_add
      >>> y, mean, var = batch_norm_add(jnp.array([[1.0], [3.0]]), jnp.array([[-5.0], [5.0]]),
      ...                               jnp.ones(1), jnp.zeros(1), relu_shortcut=True)
      >>> y[:, 0]
      Array([-0.999995,  5.999995], dtype=float32)
    """
    if (shortcut_scale is None) != (shortcut_bias is None):
        raise ValueError("give both shortcut_scale and shortcut_bias, or neither.")
    if relu_shortcut and shortcut_scale is not None:
        raise ValueError("relu_shortcut applies to a shortcut that is not normalised.")
    if shortcut.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"shortcut has shape {shortcut.shape}; x has {x.shape}.")
    dtype = jnp.dtype(x.dtype if dtype is None else dtype)
    out, stats = _batch_norm_add(
        x, shortcut, scale, bias, shortcut_scale, shortcut_bias,
        epsilon, relu_shortcut, dtype, x.dtype,
    )  # fmt: skip
    return (out, *stats)


def _added(shortcut, relu_shortcut):
    return _positive(shortcut) if relu_shortcut else shortcut


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _batch_norm_add(
    x, shortcut, scale, bias, s_scale, s_bias, epsilon, relu_shortcut, dtype, x_dtype
):
    args = (x, shortcut, scale, bias, s_scale, s_bias, epsilon, relu_shortcut, dtype, x_dtype)
    return _batch_norm_add_fwd(*args)[0]


def _batch_norm_add_fwd(
    x, shortcut, scale, bias, s_scale, s_bias, epsilon, relu_shortcut, dtype, x_dtype
):
    y, mean, var, inv_std = _batch_norm_forward(x, scale, bias, epsilon, False, dtype)
    if s_scale is None:
        added, s_stats, s_saved = _added(shortcut, relu_shortcut), (), ()
    else:
        added, s_mean, s_var, s_inv_std = _batch_norm_forward(
            shortcut, s_scale, s_bias, epsilon, False, dtype
        )
        s_stats, s_saved = (s_mean, s_var), (s_mean, s_inv_std)
    out = y + added
    residuals = (out, shortcut, inv_std, scale, bias, s_saved, s_scale, s_bias)
    return (out, (mean, var, *s_stats)), residuals


def _batch_norm_add_bwd(epsilon, relu_shortcut, dtype, x_dtype, residuals, cotangents):
    out, shortcut, inv_std, scale, bias, s_saved, s_scale, s_bias = residuals
    g, (g_mean, g_var, *g_s_stats) = cotangents
    # See _batch_norm_relu_conv_bwd.
    (out, shortcut, inv_std, s_saved), g = jax.lax.optimization_barrier(
        ((out, shortcut, inv_std, s_saved), g)
    )
    if s_scale is None:
        added = _added(shortcut, relu_shortcut)
    else:
        # The forward pass's expression, so that the sum minus it is x's normalised value.
        added = _normalised(shortcut, *s_saved, s_scale, s_bias, relu=False).astype(dtype)
    f32 = inv_std.dtype
    normalised = (out.astype(f32) - added.astype(f32) - bias) / scale
    g_x, g_scale, g_bias = _normalised_grads(
        normalised, inv_std, scale, g.astype(f32), g_mean, g_var
    )
    if s_scale is None:
        g_shortcut = jnp.where(shortcut > 0, g, jnp.zeros((), g.dtype)) if relu_shortcut else g
        s_grads = (None, None)
    else:
        g_shortcut, *s_grads = _batch_norm_grads(
            shortcut, *s_saved, s_scale, s_bias, False, g, *g_s_stats
        )
    return (
        g_x.astype(x_dtype),
        g_shortcut.astype(shortcut.dtype),
        g_scale.astype(scale.dtype),
        g_bias.astype(bias.dtype),
        *s_grads,
    )


_batch_norm_add.defvjp(_batch_norm_add_fwd, _batch_norm_add_bwd)


class BatchNorm(nn.Module):
    """``flax.linen.BatchNorm`` over the last axis, with :func:`batch_norm`'s lean backward pass.

    A drop-in replacement: the same variables (``params``: ``scale``,
    ``bias``; ``batch_stats``: ``mean``, ``var``), the same statistics and the
    same outputs. ``relu=True`` fuses the ReLU that usually follows, so that
    its mask is not stored either. Cross-device statistics (``axis_name``)
    are not supported; under ``jax.sharding`` the compiler reduces across
    devices by itself.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxoffload.layers import BatchNorm
      >>> x = jnp.arange(8.0).reshape(4, 2)
      >>> variables = BatchNorm(use_running_average=False).init(jax.random.key(0), x)
      >>> jax.tree.map(jnp.shape, variables)
      {'batch_stats': {'mean': (2,), 'var': (2,)}, 'params': {'bias': (2,), 'scale': (2,)}}
    """

    use_running_average: bool | None = None
    momentum: float = 0.99
    epsilon: float = 1e-5
    dtype: Any = None
    param_dtype: Any = jnp.float32
    relu: bool = False

    def __call__(
        self,
        x: jax.Array,
        use_running_average: bool | None = None,
        *,
        conv_kernel: jax.Array | None = None,
        shortcut: jax.Array | None = None,
        relu_shortcut: bool = False,
        shortcut_norm: BatchNorm | None = None,
        **conv_kwargs: Any,
    ) -> jax.Array:
        """Normalises ``x``; with ``conv_kernel``, convolves the result too (see :func:`conv_after`).

        ``conv_kernel`` needs ``relu=True``; ``conv_kwargs`` are the other
        arguments of ``jax.lax.conv_general_dilated``.

        With ``shortcut``, adds it to the result, through
        :func:`batch_norm_add` (which needs ``relu=False``): as it is,
        ``relu(shortcut)`` if ``relu_shortcut``, or ``shortcut_norm(shortcut)``
        given another ``BatchNorm`` (made where it would be called, so that
        it is named as flax would name it; same ``epsilon`` and ``dtype``).
        """
        use_running_average = nn.merge_param(
            "use_running_average", self.use_running_average, use_running_average
        )
        if conv_kernel is not None and not self.relu:
            raise ValueError("BatchNorm convolves its output (conv_kernel) only with relu=True.")
        if shortcut is not None and (self.relu or conv_kernel is not None):
            raise ValueError("BatchNorm adds a shortcut only with relu=False and no conv_kernel.")
        if (relu_shortcut or shortcut_norm is not None) and shortcut is None:
            raise ValueError("relu_shortcut and shortcut_norm need a shortcut.")
        if shortcut_norm is not None and (
            shortcut_norm.relu
            or (shortcut_norm.epsilon, shortcut_norm.dtype) != (self.epsilon, self.dtype)
        ):
            raise ValueError(
                "shortcut_norm needs relu=False and this BatchNorm's epsilon and dtype."
            )
        scale, bias, ra_mean, ra_var = self._variables(x.shape[-1])
        dtype = self.dtype or jnp.result_type(x, scale, bias)
        if use_running_average:
            y = self._normalise_with_running_statistics(x, scale, bias, ra_mean, ra_var, dtype)
            y = relu(y) if self.relu else y
            if shortcut_norm is not None:
                variables = shortcut_norm._variables(shortcut.shape[-1])
                return y + self._normalise_with_running_statistics(shortcut, *variables, dtype)
            if shortcut is not None:
                return y + _added(shortcut, relu_shortcut)
            if conv_kernel is None:
                return y
            return jax.lax.conv_general_dilated(y, conv_kernel, **conv_kwargs)
        if shortcut_norm is not None:
            s_scale, s_bias, s_ra_mean, s_ra_var = shortcut_norm._variables(shortcut.shape[-1])
            y, mean, var, s_mean, s_var = batch_norm_add(
                x, shortcut, scale, bias, epsilon=self.epsilon, shortcut_scale=s_scale,
                shortcut_bias=s_bias, dtype=dtype,
            )  # fmt: skip
            shortcut_norm._update(s_ra_mean, s_ra_var, s_mean, s_var)
        elif shortcut is not None:
            y, mean, var = batch_norm_add(
                x, shortcut, scale, bias, epsilon=self.epsilon, relu_shortcut=relu_shortcut,
                dtype=dtype,
            )  # fmt: skip
        elif conv_kernel is None:
            y, mean, var = batch_norm(
                x, scale, bias, epsilon=self.epsilon, relu=self.relu, dtype=dtype
            )
        else:
            y, mean, var = batch_norm_relu_conv(
                x, scale, bias, conv_kernel, epsilon=self.epsilon, dtype=dtype, **conv_kwargs
            )
        self._update(ra_mean, ra_var, mean, var)
        return y

    @nn.compact
    def _variables(self, features: int):
        """``(scale, bias, running mean, running var)``; the last two are flax ``Variable``s."""
        ra_mean = self.variable("batch_stats", "mean", lambda: jnp.zeros((features,), jnp.float32))
        ra_var = self.variable("batch_stats", "var", lambda: jnp.ones((features,), jnp.float32))
        scale = self.param("scale", nn.initializers.ones, (features,), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (features,), self.param_dtype)
        return scale, bias, ra_mean, ra_var

    def _normalise_with_running_statistics(self, x, scale, bias, ra_mean, ra_var, dtype):
        inv_std = jax.lax.rsqrt(ra_var.value + self.epsilon)
        return ((x - ra_mean.value) * (inv_std * scale) + bias).astype(dtype)

    def _update(self, ra_mean, ra_var, mean, var) -> None:
        if not self.is_initializing():
            ra_mean.value = self.momentum * ra_mean.value + (1 - self.momentum) * mean
            ra_var.value = self.momentum * ra_var.value + (1 - self.momentum) * var


def conv_after(norm: BatchNorm) -> Callable[..., jax.Array]:
    """A ``conv_general_dilated`` for ``flax.linen.Conv`` that applies ``norm`` to its input first.

    ``nn.Conv(..., conv_general_dilated=conv_after(norm))(x)`` computes
    ``nn.Conv(...)(norm(x))`` with the same variables, through
    :func:`batch_norm_relu_conv`: the convolution's input is recomputed in the
    backward pass rather than stored. ``norm`` needs ``relu=True``, and must
    be made where ``nn.Conv`` is, so that it is named as flax would name it.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> from jaxoffload.layers import BatchNorm, conv_after
      >>> class Block(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         norm = BatchNorm(use_running_average=False, relu=True)
      ...         return nn.Conv(4, (3, 3), conv_general_dilated=conv_after(norm))(x)
      >>> variables = Block().init(jax.random.key(0), jnp.ones((1, 5, 5, 2)))
      >>> sorted(variables["params"])
      ['BatchNorm_0', 'Conv_0']
    """

    def conv_general_dilated(lhs, rhs, window_strides, padding, **conv_kwargs):
        return norm(
            lhs, conv_kernel=rhs, window_strides=window_strides, padding=padding, **conv_kwargs
        )

    return conv_general_dilated
