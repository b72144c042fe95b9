"""EfficientNet in plain Flax, written as a user writes it: the paper's B0, in torchvision's layout.

Nothing here imports jaxoffload. ``block_cls`` takes any MBConv class, such as
``jaxoffload.linen.wrap(MBConv, jaxoffload.Lean())``. Tan and Le, "EfficientNet: Rethinking
Model Scaling for Convolutional Neural Networks" (2019). Stochastic depth and dropout are left
out: the benchmarks compare strategies at the same arithmetic, and both draw random masks.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

ModuleDef = Any

# The paper's Table 1 for B0: (expansion, kernel, first stride, output channels, repeats).
EFFICIENTNET_B0_STAGES = (
    (1, 3, 1, 16, 1),
    (6, 3, 2, 24, 2),
    (6, 5, 2, 40, 2),
    (6, 3, 2, 80, 3),
    (6, 5, 1, 112, 3),
    (6, 5, 2, 192, 4),
    (6, 3, 1, 320, 1),
)


def _batch_norm(train: bool, dtype: Any):
    return functools.partial(
        nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5, dtype=dtype
    )


class MBConv(nn.Module):
    """1x1 expansion, kxk depthwise, squeeze-and-excitation, 1x1 linear projection; the shortcut."""

    features: int
    expansion: int
    kernel: int
    strides: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = True):
        norm = _batch_norm(train, self.dtype)
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        inputs = x.shape[-1]
        wide = inputs * self.expansion
        y = x
        if self.expansion != 1:
            y = nn.silu(norm()(conv(wide, (1, 1))(y)))
        k = self.kernel
        y = conv(wide, (k, k), self.strides, padding=k // 2, feature_group_count=wide)(y)
        y = nn.silu(norm()(y))
        # Squeeze and excitation, to a quarter of the block's input channels.
        squeezed = jnp.mean(y, axis=(1, 2), keepdims=True)
        squeezed = nn.silu(nn.Conv(max(1, inputs // 4), (1, 1), dtype=self.dtype)(squeezed))
        y = y * nn.sigmoid(nn.Conv(wide, (1, 1), dtype=self.dtype)(squeezed))
        y = norm()(conv(self.features, (1, 1))(y))
        if self.strides == 1 and inputs == self.features:
            y = x + y
        return y


class EfficientNet(nn.Module):
    """EfficientNet: a 3x3 stem, MBConv stages as ``stages`` lists them, a 1x1 head, NHWC."""

    stages: Sequence[tuple[int, int, int, int, int]] = EFFICIENTNET_B0_STAGES
    block_cls: ModuleDef = MBConv
    num_classes: int = 1000
    stem_features: int = 32
    head_features: int = 1280
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = True):
        norm = _batch_norm(train, self.dtype)
        x = nn.Conv(self.stem_features, (3, 3), 2, padding=1, use_bias=False, dtype=self.dtype)(x)
        x = nn.silu(norm()(x))
        for expansion, kernel, strides, features, repeats in self.stages:
            for n in range(repeats):
                block = self.block_cls(
                    features, expansion, kernel, strides if n == 0 else 1, dtype=self.dtype
                )
                x = block(x, train)
        x = nn.Conv(self.head_features, (1, 1), use_bias=False, dtype=self.dtype)(x)
        x = nn.silu(norm()(x))
        x = nn.Dense(self.num_classes, dtype=self.dtype)(jnp.mean(x, axis=(1, 2)))
        return jnp.asarray(x, self.dtype)


EfficientNetB0 = functools.partial(EfficientNet, stages=EFFICIENTNET_B0_STAGES)
