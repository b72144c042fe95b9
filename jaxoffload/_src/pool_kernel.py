"""A Pallas (Triton) kernel: the input gradient of a 3x3, stride-2, padding-1 max pool.

That is ResNet's stem pool. ``layers.Pool.route`` computes the same gradient
with XLA's elementwise operations, which write it in several passes. This kernel
writes each element of the gradient once, and gives the same values bit for bit;
``docs/design.md`` says what it measured against XLA's route.

Geometry, per spatial dimension: window ``o`` covers input ``2o - 1``, ``2o``
and ``2o + 1``. With an even input size, input ``2m`` lies only in window
``m`` (its middle), and input ``2m + 1`` lies in windows ``m + 1`` (its first)
and ``m`` (its last). One program handles one image and one window row ``m``.
It reads ``g`` and ``first`` at window rows ``m`` and ``m + 1``, and writes input
rows ``2m`` and ``2m + 1``. Columns split the same way.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["applies", "route"]

GEOMETRY = ((3, 3), (2, 2), ((1, 1), (1, 1)))


def applies(window, strides, pads, shape, dtype) -> bool:
    """Whether :func:`route` computes this pool's gradient: NHWC, even sizes, bf16 or f32."""
    return (
        (tuple(window), tuple(strides), tuple(pads)) == GEOMETRY
        and len(shape) == 4
        and shape[1] % 2 == 0
        and shape[2] % 2 == 0
        and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
        # Element offsets are int32.
        and math.prod(shape) < 2**31
    )


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _kernel(g_ref, first_ref, out_ref, *, rows: int, cols: int, channels: int):
    """Input rows ``2m`` and ``2m + 1`` of image ``b``, from window rows ``m`` and ``m + 1``.

    Triton's tensors have power-of-two sizes, so each load and store covers
    ``k`` columns and ``c`` channels rounded up, masked. Integer-array indices
    give Triton the same pointers that slices would, and the interpreter
    (CPU tests) takes them too.
    """
    b, m = pl.program_id(0), pl.program_id(1)
    shape = (_pow2(cols), _pow2(channels))
    k = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    c = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    zero = jnp.zeros(shape, out_ref.dtype)

    def window_row(row):
        """``(g, first)`` at window columns ``k`` and ``k + 1`` of a window row; none past the last."""
        inside = row < rows
        row = jnp.minimum(row, rows - 1)  # an address in bounds; the mask drops the values
        pairs = []
        for shift in (0, 1):
            mask = (c < channels) & (k + shift < cols) & inside
            # -1 is no window position: masked lanes pass no gradient.
            first = plgpu.load(first_ref.at[b, row, k + shift, c], mask=mask, other=-1)
            g = plgpu.load(g_ref.at[b, row, k + shift, c], mask=mask)
            pairs.append((g, first))
        return pairs

    def total(*shares):
        # The XLA route's order and rounding: ((0 + s0) + s1) + ..., each sum in the dtype.
        acc = zero
        for (g, first), position in shares:
            share = jnp.where(first == position, g, zero)
            acc = (acc.astype(jnp.float32) + share.astype(jnp.float32)).astype(acc.dtype)
        return acc

    def store(dy, dx, value):
        mask = (c < channels) & (k < cols)
        plgpu.store(out_ref.at[b, 2 * m + dy, 2 * k + dx, c], value, mask=mask)

    # a0, a1: windows (m, k), (m, k + 1); b0, b1: windows (m + 1, k), (m + 1, k + 1).
    # A window position is 3 * row + column within the window.
    (a0, a1), (b0, b1) = window_row(m), window_row(m + 1)
    store(0, 0, total((a0, 4)))
    store(0, 1, total((a1, 3), (a0, 5)))
    store(1, 0, total((b0, 1), (a0, 7)))
    store(1, 1, total((b1, 0), (b0, 2), (a1, 6), (a0, 8)))


@functools.partial(jax.jit, static_argnames=("shape", "interpret"))
def route(g: jax.Array, first: jax.Array, shape: tuple[int, ...], interpret: bool = False):
    """The gradient of an NHWC input of ``shape`` (see :func:`applies`).

    Args:
      g: ``(batch, height / 2, width / 2, channels)``: the pooled output's cotangent.
      first: the same shape, int8: each window's first maximum, ``3 * row + column``.
      shape: the input's shape.
      interpret: run in Pallas' interpreter, on any backend (for tests).
    """
    batch, height, width, channels = shape
    kernel = functools.partial(_kernel, rows=height // 2, cols=width // 2, channels=channels)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(shape, g.dtype),
        grid=(batch, height // 2),
        interpret=interpret,
        # The fastest of 4 or 8 warps with 1, 2 or 4 window rows per program, as measured.
        compiler_params=plgpu.CompilerParams(num_warps=8),
    )(g, first)
