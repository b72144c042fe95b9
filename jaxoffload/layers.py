"""CNN layers whose backward pass needs less device memory than jax's defaults."""

from __future__ import annotations

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
    "batch_norm_relu_conv",
    "conv_after",
    "max_pool",
    "relu",
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
    axes = tuple(range(x.ndim - 1))
    count = x.size // x.shape[-1]
    centred = x.astype(mean.dtype) - mean
    normalised = centred * inv_std
    g = g.astype(mean.dtype)
    if relu:
        g = jnp.where(_normalised(x, mean, inv_std, scale, bias, relu=False) > 0, g, 0.0)
    g_bias = g.sum(axes)
    g_scale = (g * normalised).sum(axes)
    g_x = (scale * inv_std) * (g - (g_bias + normalised * g_scale) / count)
    # The statistics are outputs too; their cotangents are zero in a loss,
    # but a user may differentiate them.
    g_x = g_x + (g_mean + 2.0 * g_var * centred) / count
    return g_x.astype(x.dtype), g_scale.astype(scale.dtype), g_bias.astype(bias.dtype)


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
    conv = tuple(sorted((k, _hashable(v)) for k, v in conv_kwargs.items()))
    return _batch_norm_relu_conv(x, scale, bias, kernel, epsilon, dtype, conv)


def _hashable(value):
    """Lists (such as padding) as tuples, so that they can be static arguments."""
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return tuple(_hashable(v) for v in value)
    return value


def _convolve(a, kernel, conv):
    return jax.lax.conv_general_dilated(a, kernel, **dict(conv))


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
    _, convolve_vjp = jax.vjp(lambda a, kernel: _convolve(a, kernel, conv), a, kernel)
    g_a, g_kernel = convolve_vjp(g_y)
    norm = (x, mean, inv_std, scale, bias)
    return (*_batch_norm_bwd(epsilon, True, dtype, norm, (g_a, g_mean, g_var)), g_kernel)


_batch_norm_relu_conv.defvjp(_batch_norm_relu_conv_fwd, _batch_norm_relu_conv_bwd)


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

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        use_running_average: bool | None = None,
        *,
        conv_kernel: jax.Array | None = None,
        **conv_kwargs: Any,
    ) -> jax.Array:
        """Normalises ``x``; with ``conv_kernel``, convolves the result too (see :func:`conv_after`).

        ``conv_kernel`` needs ``relu=True``; ``conv_kwargs`` are the other
        arguments of ``jax.lax.conv_general_dilated``.
        """
        use_running_average = nn.merge_param(
            "use_running_average", self.use_running_average, use_running_average
        )
        if conv_kernel is not None and not self.relu:
            raise ValueError("BatchNorm convolves its output (conv_kernel) only with relu=True.")
        features = x.shape[-1]
        ra_mean = self.variable("batch_stats", "mean", lambda: jnp.zeros((features,), jnp.float32))
        ra_var = self.variable("batch_stats", "var", lambda: jnp.ones((features,), jnp.float32))
        scale = self.param("scale", nn.initializers.ones, (features,), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (features,), self.param_dtype)
        dtype = self.dtype or jnp.result_type(x, scale, bias)
        if use_running_average:
            inv_std = jax.lax.rsqrt(ra_var.value + self.epsilon)
            y = ((x - ra_mean.value) * (inv_std * scale) + bias).astype(dtype)
            y = relu(y) if self.relu else y
            if conv_kernel is None:
                return y
            return jax.lax.conv_general_dilated(y, conv_kernel, **conv_kwargs)
        if conv_kernel is None:
            y, mean, var = batch_norm(
                x, scale, bias, epsilon=self.epsilon, relu=self.relu, dtype=dtype
            )
        else:
            y, mean, var = batch_norm_relu_conv(
                x, scale, bias, conv_kernel, epsilon=self.epsilon, dtype=dtype, **conv_kwargs
            )
        if not self.is_initializing():
            ra_mean.value = self.momentum * ra_mean.value + (1 - self.momentum) * mean
            ra_var.value = self.momentum * ra_var.value + (1 - self.momentum) * var
        return y


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
