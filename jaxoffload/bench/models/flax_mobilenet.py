"""MobileNetV2 in plain Flax, written as a user writes it: the paper's table, in torchvision's layout.

Nothing here imports jaxoffload. ``block_cls`` takes any inverted-residual
class, such as ``jaxoffload.linen.wrap(InvertedResidual, jaxoffload.Lean())``.
Sandler et al., "MobileNetV2: Inverted Residuals and Linear Bottlenecks" (2018).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

ModuleDef = Any

# The paper's Table 2: (expansion t, output channels c, repeats n, first stride s).
MOBILENETV2_STAGES = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


def make_divisible(channels: float, divisor: int = 8) -> int:
    """``channels`` rounded to a multiple of ``divisor``, never below 90% of it (the reference code's rule)."""
    rounded = max(divisor, int(channels + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * channels else rounded


class InvertedResidual(nn.Module):
    """1x1 expansion, 3x3 depthwise and 1x1 linear projection, each with BatchNorm; the shortcut."""

    features: int
    expansion: int
    conv: ModuleDef
    norm: ModuleDef
    act: Callable
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        expanded = x.shape[-1] * self.expansion
        y = x
        if self.expansion != 1:
            y = self.act(self.norm()(self.conv(expanded, (1, 1))(y)))
        y = self.conv(expanded, (3, 3), self.strides, padding=1, feature_group_count=expanded)(y)
        y = self.act(self.norm()(y))
        # The projection is linear: no activation after it.
        y = self.norm()(self.conv(self.features, (1, 1))(y))
        if self.strides == (1, 1) and x.shape[-1] == self.features:
            return x + y
        return y


class MobileNetV2(nn.Module):
    """MobileNetV2: a 3x3 stem, the inverted-residual stages, a 1x1 head conv and a classifier, NHWC.

    ``width_multiplier`` is the paper's alpha: it scales every layer's
    channels (to multiples of 8) but the head's, which stay
    ``head_features`` below 1.
    """

    block_cls: ModuleDef = InvertedResidual
    num_classes: int = 1000
    width_multiplier: float = 1.0
    stages: Sequence[tuple[int, int, int, int]] = MOBILENETV2_STAGES
    stem_features: int = 32
    head_features: int = 1280
    dropout_rate: float = 0.2
    dtype: Any = jnp.float32
    act: Callable = nn.relu6

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
        )
        width = functools.partial(make_divisible, divisor=8)
        stem = width(self.stem_features * self.width_multiplier)
        x = conv(stem, (3, 3), (2, 2), padding=1, name="conv_init")(x)
        x = self.act(norm(name="bn_init")(x))
        for expansion, channels, repeats, stride in self.stages:
            for j in range(repeats):
                strides = (stride, stride) if j == 0 else (1, 1)
                x = self.block_cls(
                    width(channels * self.width_multiplier),
                    expansion,
                    conv=conv,
                    norm=norm,
                    act=self.act,
                    strides=strides,
                )(x)
        head = width(self.head_features * max(1.0, self.width_multiplier))
        x = self.act(norm(name="bn_head")(conv(head, (1, 1), name="conv_head")(x)))
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
        x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
        return jnp.asarray(x, self.dtype)
