"""ResNets (He et al., 2015) in Flax linen, NHWC, torchvision's v1.5 layout."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxoffload.models.common import CONV_NAME, check_strategies, wrap_block

__all__ = ["BasicBlock", "BottleneckBlock", "ResNet", "RESNETS"]

# name: (blocks per stage, block kind)
RESNETS = {
    "resnet18": ((2, 2, 2, 2), "basic"),
    "resnet34": ((3, 4, 6, 3), "basic"),
    "resnet50": ((3, 4, 6, 3), "bottleneck"),
    "resnet101": ((3, 4, 23, 3), "bottleneck"),
    "resnet152": ((3, 8, 36, 3), "bottleneck"),
}


def _layers(dtype: Any, train: bool):
    conv = functools.partial(nn.Conv, use_bias=False, dtype=dtype)
    norm = functools.partial(
        nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5, dtype=dtype
    )
    return conv, norm


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm, and the shortcut (ResNet-18 and -34)."""

    features: int
    strides: int = 1
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv, norm = _layers(self.dtype, train)
        s = (self.strides, self.strides)
        y = checkpoint_name(conv(self.features, (3, 3), s, padding=1)(x), CONV_NAME)
        y = nn.relu(norm()(y))
        y = checkpoint_name(conv(self.features, (3, 3), padding=1)(y), CONV_NAME)
        y = norm()(y)
        if x.shape != y.shape:
            x = norm()(conv(self.features, (1, 1), s)(x))
        return nn.relu(x + y)


class BottleneckBlock(nn.Module):
    """1x1, 3x3 (strided) and 1x1 convolutions with BatchNorm, and the shortcut."""

    features: int
    strides: int = 1
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv, norm = _layers(self.dtype, train)
        s = (self.strides, self.strides)
        y = checkpoint_name(conv(self.features, (1, 1))(x), CONV_NAME)
        y = nn.relu(norm()(y))
        y = checkpoint_name(conv(self.features, (3, 3), s, padding=1)(y), CONV_NAME)
        y = nn.relu(norm()(y))
        y = checkpoint_name(conv(self.features * 4, (1, 1))(y), CONV_NAME)
        y = norm()(y)
        if x.shape != y.shape:
            x = norm()(conv(self.features * 4, (1, 1), s)(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    """ResNet with a 7x7 stem, four stages and a linear classifier.

    Attributes:
      stage_sizes: blocks per stage, e.g. ``(3, 4, 6, 3)``.
      block: ``"basic"`` or ``"bottleneck"``.
      num_classes: classifier outputs.
      dtype: compute dtype; parameters are float32.
      block_strategies: one entry of ``BLOCK_STRATEGIES`` per residual block, or
        empty for all ``"none"``. The stem and the classifier are never wrapped.
    """

    stage_sizes: Sequence[int] = (3, 4, 6, 3)
    block: str = "bottleneck"
    num_classes: int = 1000
    dtype: Any = jnp.float32
    block_strategies: Sequence[str] = ()

    @nn.compact
    def __call__(self, x, train: bool = True):
        if self.block not in ("basic", "bottleneck"):
            raise ValueError(f"block must be 'basic' or 'bottleneck', got {self.block!r}.")
        strategies = iter(check_strategies(self.block_strategies, sum(self.stage_sizes)))
        kind = BasicBlock if self.block == "basic" else BottleneckBlock
        conv, norm = _layers(self.dtype, train)
        x = conv(64, (7, 7), (2, 2), padding=3, name="stem_conv")(x)
        x = nn.relu(norm(name="stem_norm")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        n = 0
        for stage, size in enumerate(self.stage_sizes):
            for i in range(size):
                block = wrap_block(kind, next(strategies), static_argnums=(2,))
                strides = 2 if stage > 0 and i == 0 else 1
                x = block(64 * 2**stage, strides, self.dtype, name=f"block{n}")(x, train)
                n += 1
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x)
