"""Hand-made lean layers of the bench's reference models: a fused BatchNorm and block tails.

The library needs none of these: its lean rules (:mod:`jaxoffload._src.rewrite`)
work on a user's unmodified Flax layers. The reference models build their
blocks from these to show what hand-fused rules keep.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxoffload.internal import relu

__all__ = [
    "BatchNorm",
    "batch_norm",
    "batch_norm_relu_conv",
    "conv_after",
    "residual_tail",
    "tail_conv",
]


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
      >>> from jaxoffload.bench.layers import batch_norm
      >>> y, mean, var = batch_norm(jnp.array([[1.0], [3.0]]), jnp.ones(1), jnp.zeros(1))
      >>> y[:, 0].round(4), mean, var
      (Array([-1.,  1.], dtype=float32), Array([2.], dtype=float32), Array([1.], dtype=float32))
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
      >>> from jaxoffload.bench.layers import batch_norm_relu_conv
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


def residual_tail(
    x: jax.Array,
    shortcut: jax.Array,
    scale: jax.Array,
    bias: jax.Array,
    kernel: jax.Array,
    out_scale: jax.Array,
    out_bias: jax.Array,
    *,
    epsilon: float = 1e-5,
    shortcut_scale: jax.Array | None = None,
    shortcut_bias: jax.Array | None = None,
    dtype: Any = None,
    **conv_kwargs: Any,
) -> tuple[jax.Array, ...]:
    """``relu(batch_norm(conv(relu(batch_norm(x)))) + s)``, a ResNet block's end, that keeps ``x`` and its output.

    ``s`` is ``shortcut``, or ``batch_norm(shortcut)`` given ``shortcut_scale``
    and ``shortcut_bias`` (a block whose shortcut is a convolution). The
    output is the next block's input, which that block keeps anyway, and it
    is also this rule's ReLU mask. The backward pass recomputes the
    convolution's input (elementwise, from ``x``) and the convolution's
    output (one convolution), so the block stores neither: a ResNet
    bottleneck keeps its input, the outputs of its first two convolutions
    and, with a shortcut convolution, that convolution's output.

    Args:
      x: ``(..., features)``: the last convolution's input, before its
        BatchNorm (``scale``, ``bias``) and ReLU.
      shortcut: the array added, of the output's shape.
      scale, bias: the first BatchNorm's parameters.
      kernel: the convolution's kernel.
      out_scale, out_bias: the BatchNorm after the convolution.
      epsilon, dtype: as in :func:`batch_norm`, for every BatchNorm here.
      shortcut_scale, shortcut_bias: normalise the shortcut with these.
      **conv_kwargs: the other arguments of ``jax.lax.conv_general_dilated``.

    Returns:
      ``(y, mean, var, out_mean, out_var)``: the output and the float32
      batch statistics of both BatchNorms; with a normalised shortcut, its
      statistics follow.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxoffload.bench.layers import residual_tail
      >>> x, kernel = jnp.arange(8.0).reshape(1, 2, 2, 2), jnp.ones((1, 1, 2, 2))
      >>> y, *stats = residual_tail(x, jnp.ones((1, 2, 2, 2)), jnp.ones(2), jnp.zeros(2),
      ...     kernel, jnp.ones(2), jnp.zeros(2), window_strides=(1, 1), padding="SAME",
      ...     dimension_numbers=("NHWC", "HWIO", "NHWC"))
      >>> y.shape, len(stats)
      ((1, 2, 2, 2), 4)
    """
    if (shortcut_scale is None) != (shortcut_bias is None):
        raise ValueError("give both shortcut_scale and shortcut_bias, or neither.")
    dtype = jnp.dtype(x.dtype if dtype is None else dtype)
    if shortcut_scale is None:
        shortcut = shortcut.astype(dtype)  # its gradient is the output's
    params = (scale, bias, kernel, out_scale, out_bias, shortcut_scale, shortcut_bias)
    out, stats = _residual_tail(x, shortcut, *params, epsilon, dtype, _conv_spec(conv_kwargs))
    return (out, *stats)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11))
def _residual_tail(
    x, shortcut, scale, bias, kernel, o_scale, o_bias, s_scale, s_bias, epsilon, dtype, conv
):
    args = (x, shortcut, scale, bias, kernel, o_scale, o_bias, s_scale, s_bias)
    return _residual_tail_fwd(*args, epsilon, dtype, conv)[0]


def _residual_tail_fwd(
    x, shortcut, scale, bias, kernel, o_scale, o_bias, s_scale, s_bias, epsilon, dtype, conv
):
    a, mean, var, inv_std = _batch_norm_forward(x, scale, bias, epsilon, True, dtype)
    y, o_mean, o_var, o_inv_std = _batch_norm_forward(
        _convolve(a, kernel, conv), o_scale, o_bias, epsilon, False, dtype
    )
    if shortcut.shape != y.shape:
        raise ValueError(f"shortcut has shape {shortcut.shape}; the convolution gives {y.shape}.")
    if s_scale is None:
        added, s_stats, s_saved = shortcut, (), None
    else:
        added, s_mean, s_var, s_inv_std = _batch_norm_forward(
            shortcut, s_scale, s_bias, epsilon, False, dtype
        )
        # A normalised shortcut's backward pass needs its input.
        s_stats, s_saved = (s_mean, s_var), (shortcut, s_mean, s_inv_std)
    out = jnp.maximum(y + added, jnp.zeros((), y.dtype))  # the ReLU, with no rule of its own
    params = (scale, bias, kernel, o_scale, o_bias, s_scale, s_bias)
    residuals = (x, mean, inv_std, o_mean, o_inv_std, out, s_saved, params)
    return (out, (mean, var, o_mean, o_var, *s_stats)), residuals


def _residual_tail_bwd(epsilon, dtype, conv, residuals, cotangents):
    x, mean, inv_std, o_mean, o_inv_std, out, s_saved, params = residuals
    scale, bias, kernel, o_scale, o_bias, s_scale, s_bias = params
    g, (g_mean, g_var, g_o_mean, g_o_var, *g_s_stats) = cotangents
    # See _batch_norm_relu_conv_bwd.
    (x, mean, inv_std, o_mean, o_inv_std, out, s_saved), g = jax.lax.optimization_barrier(
        ((x, mean, inv_std, o_mean, o_inv_std, out, s_saved), g)
    )
    a = _normalised(x, mean, inv_std, scale, bias, relu=True).astype(dtype)
    g_sum = jnp.where(out > 0, g, jnp.zeros((), g.dtype))
    g_c, g_o_scale, g_o_bias = _batch_norm_grads(
        _convolve(a, kernel, conv), o_mean, o_inv_std, o_scale, o_bias, False, g_sum,
        g_o_mean, g_o_var,
    )  # fmt: skip
    g_a, g_kernel = _convolve_grads(a, kernel, conv, g_c)
    g_x, g_scale, g_bias = _batch_norm_grads(
        x, mean, inv_std, scale, bias, True, g_a, g_mean, g_var
    )
    if s_saved is None:
        g_shortcut, s_grads = g_sum, (None, None)
    else:
        shortcut, s_mean, s_inv_std = s_saved
        g_shortcut, *s_grads = _batch_norm_grads(
            shortcut, s_mean, s_inv_std, s_scale, s_bias, False, g_sum, *g_s_stats
        )
    return (g_x, g_shortcut, g_scale, g_bias, g_kernel, g_o_scale, g_o_bias, *s_grads)


_residual_tail.defvjp(_residual_tail_fwd, _residual_tail_bwd)


# flax.linen.BatchNorm's arguments that the lean rule does not take: the value it
# takes, and what it computes instead.
_FIXED = {
    "axis_name": (None, "no cross-device statistics (under jax.jit, XLA reduces sharded inputs "
                  "across devices by itself)"),
    "axis_index_groups": (None, "no cross-device statistics"),
    "use_fast_variance": (True, "the variance as mean(x²) - mean(x)² only"),
    "force_float32_reductions": (True, "its statistics in float32 at least"),
}  # fmt: skip


class BatchNorm(nn.Module):
    """``flax.linen.BatchNorm`` over the last axis, with :func:`batch_norm`'s lean backward pass.

    A drop-in replacement: the same arguments, in the same order, the same
    variables (``params``: ``scale``, ``bias``; ``batch_stats``: ``mean``,
    ``var``), the same statistics and the same outputs. ``relu=True`` fuses
    the ReLU that usually follows, so that its mask is not stored either.
    The features must be on the last axis. What the rule does not compute
    is refused by name: cross-device statistics (``axis_name``,
    ``axis_index_groups``; under ``jax.jit`` the compiler reduces sharded
    inputs across devices by itself), ``use_fast_variance=False``,
    ``force_float32_reductions=False`` and a ``mask``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxoffload.bench.layers import BatchNorm
      >>> x = jnp.arange(8.0).reshape(4, 2)
      >>> variables = BatchNorm(use_running_average=False).init(jax.random.key(0), x)
      >>> jax.tree.map(jnp.shape, variables)
      {'batch_stats': {'mean': (2,), 'var': (2,)}, 'params': {'bias': (2,), 'scale': (2,)}}
    """

    use_running_average: bool | None = None
    axis: int | Sequence[int] = -1
    momentum: float = 0.99
    epsilon: float = 1e-5
    dtype: Any = None
    param_dtype: Any = jnp.float32
    use_bias: bool = True
    use_scale: bool = True
    bias_init: Callable[..., Any] = nn.initializers.zeros
    scale_init: Callable[..., Any] = nn.initializers.ones
    axis_name: str | None = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True
    force_float32_reductions: bool = True
    relu: bool = False

    def __post_init__(self):
        for name, (value, instead) in _FIXED.items():
            given = getattr(self, name)
            if given is value or (value is not None and given == value):
                continue
            raise ValueError(
                f"jaxoffload.bench.layers.BatchNorm computes {instead}, so it takes no "
                f"{name}={given!r}: leave {name} out, or use flax.linen.BatchNorm for this layer."
            )
        super().__post_init__()

    def __call__(
        self,
        x: jax.Array,
        use_running_average: bool | None = None,
        *,
        mask: jax.Array | None = None,
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
        if mask is not None:
            raise ValueError(
                "jaxoffload.bench.layers.BatchNorm takes no mask: use flax.linen.BatchNorm for this layer."
            )
        if conv_kernel is None and conv_kwargs:
            raise TypeError(
                f"BatchNorm got the unexpected keyword arguments {sorted(conv_kwargs)}; they are "
                "for the convolution, and need conv_kernel."
            )
        if conv_kernel is not None and not self.relu:
            raise ValueError("BatchNorm convolves its output (conv_kernel) only with relu=True.")
        scale, bias, ra_mean, ra_var = self._variables(x.shape[-1], x.ndim)
        dtype = self._dtype(x, scale, bias)
        if use_running_average:
            y = self._normalise_with_running_statistics(x, scale, bias, ra_mean, ra_var, dtype)
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
        self._update(ra_mean, ra_var, mean, var)
        return y

    @nn.compact
    def _variables(self, features: int, ndim: int):
        """``(scale, bias, running mean, running var)``; the last two are flax ``Variable``s.

        Without ``use_scale`` or ``use_bias``, that parameter is a constant
        of ones or zeros, which the rules multiply or add exactly.
        """
        axes = self.axis if isinstance(self.axis, Sequence) else (self.axis,)
        if [a % ndim for a in axes] != [ndim - 1]:
            raise ValueError(
                f"BatchNorm(axis={self.axis!r}) takes the features of this {ndim}-d input from "
                f"axes {sorted(a % ndim for a in axes)}, but jaxoffload.bench.layers.BatchNorm takes "
                "them from the last axis only: write axis=-1 and move the features last "
                "(jnp.moveaxis), or use flax.linen.BatchNorm for this layer."
            )
        ra_mean = self.variable("batch_stats", "mean", lambda: jnp.zeros((features,), jnp.float32))
        ra_var = self.variable("batch_stats", "var", lambda: jnp.ones((features,), jnp.float32))
        shape = (features,)
        if self.use_scale:
            scale = self.param("scale", self.scale_init, shape, self.param_dtype)
        else:
            scale = jnp.ones(shape, self.param_dtype)
        if self.use_bias:
            bias = self.param("bias", self.bias_init, shape, self.param_dtype)
        else:
            bias = jnp.zeros(shape, self.param_dtype)
        return scale, bias, ra_mean, ra_var

    def _dtype(self, x, scale, bias):
        """The output's dtype, as flax's: ``dtype``, or that of ``x`` and the parameters it has."""
        params = [p for p, used in ((scale, self.use_scale), (bias, self.use_bias)) if used]
        return self.dtype or jnp.result_type(x, *params)

    def _normalise_with_running_statistics(self, x, scale, bias, ra_mean, ra_var, dtype):
        inv_std = jax.lax.rsqrt(ra_var.value + self.epsilon)
        return ((x - ra_mean.value) * (inv_std * scale) + bias).astype(dtype)

    def _update(self, ra_mean, ra_var, mean, var) -> None:
        if not self.is_initializing():
            ra_mean.value = self.momentum * ra_mean.value + (1 - self.momentum) * mean
            ra_var.value = self.momentum * ra_var.value + (1 - self.momentum) * var


def tail_conv(
    before: BatchNorm, after: BatchNorm, shortcut: jax.Array, shortcut_norm: BatchNorm | None = None
) -> Callable[..., jax.Array]:
    """A ``conv_general_dilated`` for ``flax.linen.Conv`` that ends a ResNet block.

    ``nn.Conv(..., conv_general_dilated=tail_conv(before, after, s))(x)``
    computes ``relu(after(nn.Conv(...)(before(x))) + s)``, or with
    ``shortcut_norm``, ``relu(after(...) + shortcut_norm(s))``, through
    :func:`residual_tail`, with flax's variables. ``before`` needs
    ``relu=True``; ``after`` and ``shortcut_norm`` need ``relu=False``, and
    all need the same ``epsilon``, ``dtype`` and ``use_running_average``.
    Make them where flax would make them, so that they are named as it would
    name them.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> from jaxoffload.bench.layers import BatchNorm, tail_conv
      >>> class Tail(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         before = BatchNorm(use_running_average=False, relu=True)
      ...         after = BatchNorm(use_running_average=False)
      ...         return nn.Conv(2, (1, 1), conv_general_dilated=tail_conv(before, after, x))(x)
      >>> variables = Tail().init(jax.random.key(0), jnp.ones((1, 5, 5, 2)))
      >>> sorted(variables["params"])
      ['BatchNorm_0', 'BatchNorm_1', 'Conv_0']
    """
    norms = (before, after) if shortcut_norm is None else (before, after, shortcut_norm)
    if before.use_running_average is None:
        raise ValueError("tail_conv's BatchNorms need use_running_average set.")
    if not before.relu or any(n.relu for n in norms[1:]):
        raise ValueError("tail_conv needs before.relu=True, and relu=False for the others.")
    if len({(n.epsilon, n.dtype, n.use_running_average) for n in norms}) > 1:
        raise ValueError(
            "tail_conv's BatchNorms need the same epsilon, dtype and use_running_average."
        )

    def conv_general_dilated(lhs, rhs, window_strides, padding, **conv_kwargs):
        conv_kwargs = dict(window_strides=window_strides, padding=padding, **conv_kwargs)
        scale, bias, ra_mean, ra_var = before._variables(lhs.shape[-1], lhs.ndim)
        o_scale, o_bias, o_ra_mean, o_ra_var = after._variables(rhs.shape[-1], lhs.ndim)
        s_scale = s_bias = None
        if shortcut_norm is not None:
            s_scale, s_bias, *s_running = shortcut_norm._variables(
                shortcut.shape[-1], shortcut.ndim
            )
        dtype = before._dtype(lhs, scale, bias)
        if before.use_running_average:
            a = before._normalise_with_running_statistics(lhs, scale, bias, ra_mean, ra_var, dtype)
            y = jax.lax.conv_general_dilated(relu(a), rhs, **conv_kwargs)
            y = after._normalise_with_running_statistics(
                y, o_scale, o_bias, o_ra_mean, o_ra_var, dtype
            )
            added = shortcut
            if shortcut_norm is not None:
                added = shortcut_norm._normalise_with_running_statistics(
                    shortcut, s_scale, s_bias, *s_running, dtype
                )
            return relu(y + added)
        out, mean, var, o_mean, o_var, *s_stats = residual_tail(
            lhs, shortcut, scale, bias, rhs, o_scale, o_bias, epsilon=before.epsilon,
            shortcut_scale=s_scale, shortcut_bias=s_bias, dtype=dtype, **conv_kwargs,
        )  # fmt: skip
        before._update(ra_mean, ra_var, mean, var)
        after._update(o_ra_mean, o_ra_var, o_mean, o_var)
        if shortcut_norm is not None:
            shortcut_norm._update(*s_running, *s_stats)
        return out

    return conv_general_dilated


def conv_after(norm: BatchNorm) -> Callable[..., jax.Array]:
    """A ``conv_general_dilated`` for ``flax.linen.Conv`` that applies ``norm`` to its input first.

    ``nn.Conv(..., conv_general_dilated=conv_after(norm))(x)`` computes
    ``nn.Conv(...)(norm(x))`` with the same variables, through
    :func:`batch_norm_relu_conv`: the convolution's input is recomputed in the
    backward pass rather than stored. ``norm`` needs ``relu=True``, and must
    be made where ``nn.Conv`` is, so that it is named as flax would name it.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> from jaxoffload.bench.layers import BatchNorm, conv_after
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
